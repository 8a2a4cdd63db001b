//! Faults planted on purpose, so that the real-cluster tier can prove it catches them: its
//! self-test (`tests/cluster/run`, docs/testing.md) builds the proxy with `--features
//! planted-faults`, rolls pods that run `--planted-fault=KIND` under the client-go load, and
//! requires that every one of them fails the tier's pass criteria. A build without the feature
//! has neither this module nor the flag.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
    /// A hung proxy: 1 in 5 of the connections still open 10 s after they were paired with a
    /// backend (the 1st, 6th, 11th, … of those, since the process started) stops being
    /// relayed then. From then on no byte
    /// moves either way and neither side is closed, reset or half-closed: both descriptors stay
    /// open until the drain deadline cuts the instance's connections, or the process exits.
    #[value(name = "hang-after-10s")]
    HangAfter10s,
    /// Every 10th accepted connection (the 10th, 20th, …) waits 3 s before it connects to a
    /// backend, so its first byte is relayed 3 s late; then it is carried as usual.
    #[value(name = "stall-3s")]
    Stall3s,
    /// Every https health check leaks one descriptor (a duplicate of its TCP socket, never
    /// closed: the connection to the backend stays open too). The check itself passes or fails
    /// as usual.
    #[value(name = "leak-fd-per-check")]
    LeakFdPerCheck,
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

/// Counts one more and says whether it is an `n`th (the `n`th, `2n`th, …): which connection
/// of a "1 in `n`" fault is hit.
fn every_nth(counter: &AtomicU64, n: u64) -> bool {
    counter.fetch_add(1, Ordering::Relaxed) % n == n - 1
}

/// Logs `what` the first time a fault is triggered (once per flag).
fn first_time(flag: &AtomicBool, what: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        tracing::warn!("PLANTED FAULT: {what} (first time; not logged again)");
    }
}

/// In the accept loop: whether this accepted connection is one to close unanswered.
pub fn close_accepted() -> bool {
    static ACCEPTED: AtomicU64 = AtomicU64::new(0);
    planted() == Some(Fault::CloseEvery25th) && every_nth(&ACCEPTED, 25)
}

/// How long `hang-after-10s` relays a hit connection before it hangs.
pub const HANG_AFTER: Duration = Duration::from_secs(10);

/// How long `stall-3s` holds a hit connection before it is served.
pub const STALL: Duration = Duration::from_secs(3);

/// When a connection has just been paired with its backend: whether it goes through [`hang`]
/// (every connection, with `hang-after-10s` planted; [`hang`] picks those to hang).
pub fn hangs_this_connection() -> bool {
    planted() == Some(Fault::HangAfter10s)
}

/// Both sockets of a connection to hang, as duplicate descriptors: dropping the future that
/// owns a socket closes its descriptor, but a socket with another descriptor still open sends
/// no FIN and no reset.
pub struct Held {
    _client: io::Result<OwnedFd>,
    _backend: io::Result<OwnedFd>,
}

impl Held {
    pub fn new(client: &TcpStream, backend: &TcpStream) -> Held {
        Held {
            _client: client.as_fd().try_clone_to_owned(),
            _backend: backend.as_fd().try_clone_to_owned(),
        }
    }
}

/// Relays a connection through `carry` (which owns the sockets) for [`HANG_AFTER`]. Of the
/// connections still open then, 1 in 5 (the 1st, 6th, 11th, …: most connections of a client
/// end within a second, so counting those that live 10 s makes the long-lived ones — watches,
/// informers, shared HTTP/2 connections — the ones hit, the first of them for sure) stops
/// being relayed: `carry` is dropped and both sockets stay open through `held`, silent, until
/// `cut` (the drain deadline). The others are carried on as usual.
pub async fn hang(
    held: Held,
    carry: impl std::future::Future<Output = ()>,
    cut: CancellationToken,
) {
    static SURVIVED: AtomicU64 = AtomicU64::new(0);
    let mut carry = Box::pin(carry);
    if tokio::time::timeout(HANG_AFTER, carry.as_mut())
        .await
        .is_ok()
    {
        return;
    }
    if SURVIVED.fetch_add(1, Ordering::Relaxed) % 5 != 0 {
        drop(held);
        carry.await;
        return;
    }
    static HUNG: AtomicBool = AtomicBool::new(false);
    first_time(
        &HUNG,
        "a connection (1 in 5 of those still open 10 s after pairing) stopped being relayed; its sockets are held open",
    );
    drop(carry);
    cut.cancelled().await;
    drop(held);
}

/// In the accept loop: whether this accepted connection is one to stall ([`STALL`]) before it
/// is served (before it connects to a backend).
pub fn stalls_this_connection() -> bool {
    static ACCEPTED: AtomicU64 = AtomicU64::new(0);
    let hit = planted() == Some(Fault::Stall3s) && every_nth(&ACCEPTED, 10);
    if hit {
        static STALLED: AtomicBool = AtomicBool::new(false);
        first_time(
            &STALLED,
            "a connection (every 10th accepted) waits 3 s before it connects to a backend",
        );
    }
    hit
}

/// In an https health check, once connected: leaks a duplicate of the check's socket.
pub fn at_https_check(tcp: &TcpStream) {
    if planted() != Some(Fault::LeakFdPerCheck) {
        return;
    }
    if let Ok(fd) = tcp.as_fd().try_clone_to_owned() {
        std::mem::forget(fd);
        static LEAKED: AtomicBool = AtomicBool::new(false);
        first_time(
            &LEAKED,
            "every https health check leaks a descriptor (a duplicate of its socket)",
        );
    }
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
        Some(
            Fault::CloseEvery25th | Fault::HangAfter10s | Fault::Stall3s | Fault::LeakFdPerCheck,
        )
        | None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::ValueEnum;

    /// Which connections a "1 in n" fault hits: the nth, the 2nth, … counted from the first.
    #[test]
    fn every_nth_hits_the_nth_the_2nth_and_so_on() {
        for (n, upto, hit) in [
            (5, 30, vec![5, 10, 15, 20, 25, 30]),
            (10, 35, vec![10, 20, 30]),
            (25, 60, vec![25, 50]),
        ] {
            let counter = AtomicU64::new(0);
            let which: Vec<u64> = (1..=upto).filter(|_| every_nth(&counter, n)).collect();
            assert_eq!(which, hit, "1 in {n}");
        }
    }

    #[test]
    fn the_flag_names_every_fault() {
        for (name, fault) in [
            ("close-every25th", Fault::CloseEvery25th),
            ("close-while-draining", Fault::CloseWhileDraining),
            ("cut-at-handoff", Fault::CutAtHandoff),
            ("hang-after-10s", Fault::HangAfter10s),
            ("stall-3s", Fault::Stall3s),
            ("leak-fd-per-check", Fault::LeakFdPerCheck),
        ] {
            assert_eq!(Fault::from_str(name, false), Ok(fault), "{name}");
        }
    }

    #[test]
    fn the_command_line_takes_the_new_faults() {
        use clap::Parser;
        for name in ["hang-after-10s", "stall-3s", "leak-fd-per-check"] {
            let cli = crate::cli::Cli::try_parse_from([
                "kube-apiserver-proxy".to_string(),
                format!("--planted-fault={name}"),
            ])
            .unwrap_or_else(|e| panic!("--planted-fault={name}: {e}"));
            let planted = cli.run.planted_fault.expect("a fault planted");
            assert_eq!(planted.to_possible_value().unwrap().get_name(), name);
        }
    }
}
