//! Connection handoff at an in-place upgrade: established client/backend pairs move to the
//! successor with the bytes read but not yet written, and it carries on copying.
//!
//! Every carried connection is registered ([`Registry::register`]) and obeys the park signal
//! of its [`crate::data::control::Control`]. At the upgrade the old
//! instance, after handing over its listening sockets, parks the connections in batches:
//!
//! 1. **Quiesce**: the connection's copy stops in both directions (also in the middle of a
//!    burst) and reports what it had read but not written — for splice, what is in the pipe
//!    ([`crate::data::copy`]). Nothing more is read from either socket.
//! 2. **Send**: duplicates of the client and backend descriptors and the pending bytes go to the
//!    successor in one `connections` message (at most [`BATCH`] pairs; see
//!    [`crate::handoff::codec`]).
//! 3. **Acknowledge**: the successor verifies each pair, answers `ack` with the `SO_COOKIE`s of
//!    the client sockets it takes, and only once that answer is written writes the pending bytes
//!    first and resumes copying.
//! 4. **Release or resume**: an acknowledged pair is closed here (its descriptors only: the
//!    sockets live on in the successor); any other pair — refused, not verifiable, or the
//!    exchange failed — resumes here, pending bytes first, and drains as on SIGTERM.
//!
//! A connection pauses from step 1 to step 4; the pauses are logged (p99 and max).

use std::collections::HashSet;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::sync::oneshot;

use crate::data::control::Registry;
use crate::data::copy::Pending;
use crate::sys;

/// Pairs per message (two descriptors each, within [`sys::MAX_FDS`]).
pub const BATCH: usize = sys::MAX_FDS / 2;
/// How long a connection may take to reach its pause point.
const PARK_TIMEOUT: Duration = Duration::from_secs(1);
/// Passes over the registry (connections accepted while the first pass ran are found by the
/// next).
const PASSES: usize = 3;

/// A request to a connection to pause and report itself.
pub struct Park {
    reply: oneshot::Sender<Parked>,
}

impl Park {
    /// A request, and where its answer arrives (an error: the connection ended first).
    pub fn new() -> (Park, oneshot::Receiver<Parked>) {
        let (reply, rx) = oneshot::channel();
        (Park { reply }, rx)
    }
}

/// A paused connection, as offered to the successor.
pub struct Parked {
    pub client: OwnedFd,
    pub backend: OwnedFd,
    pub client_addr: SocketAddr,
    /// `SO_COOKIE` of the client socket: the successor acknowledges by it.
    pub cookie: u64,
    pub pending: Pending,
    /// `true`: the successor took it (close ours); `false` or dropped: resume here.
    verdict: oneshot::Sender<bool>,
}

/// The connection's side of a park: offers itself (duplicates of its descriptors and a copy of
/// its pending bytes) and waits for the verdict. `true`: taken by the successor.
pub async fn offer(
    park: Park,
    client: &TcpStream,
    backend: &TcpStream,
    client_addr: SocketAddr,
    pending: &Pending,
) -> bool {
    let dup = |s: &TcpStream| s.as_fd().try_clone_to_owned();
    let (Ok(c), Ok(b), Ok(identity)) = (dup(client), dup(backend), sys::identity(client.as_fd()))
    else {
        return false;
    };
    let (verdict, taken) = oneshot::channel();
    let parked = Parked {
        client: c,
        backend: b,
        client_addr,
        cookie: identity.cookie,
        pending: pending.clone(),
        verdict,
    };
    if park.reply.send(parked).is_err() {
        return false;
    }
    taken.await.unwrap_or(false)
}

/// What handing connections over came to.
#[derive(Debug, Default)]
pub struct Summary {
    pub offered: usize,
    pub taken: usize,
    /// Each parked connection's pause, from the park request to its verdict.
    pub pauses: Vec<Duration>,
}

impl Summary {
    /// The `q` quantile of the pauses (0 when none).
    pub fn pause_quantile(&self, q: f64) -> Duration {
        if self.pauses.is_empty() {
            return Duration::ZERO;
        }
        let mut p = self.pauses.clone();
        p.sort();
        let i = ((p.len() as f64 * q).ceil() as usize).clamp(1, p.len()) - 1;
        p[i]
    }
}

/// Parks every registered connection in batches and sends each batch with `send`, which
/// returns the cookies of the client sockets the successor took (an error: none).
pub async fn hand_over<F, Fut>(registry: &Registry<Park>, mut send: F) -> Summary
where
    F: FnMut(Vec<Parked>) -> Fut,
    Fut: std::future::Future<Output = (Vec<Parked>, HashSet<u64>)>,
{
    let mut summary = Summary::default();
    let mut seen: HashSet<u64> = HashSet::new();
    for _ in 0..PASSES {
        let fresh = registry.fresh(&mut seen);
        if fresh.is_empty() {
            break;
        }
        for batch in fresh.chunks(BATCH) {
            let started = Instant::now();
            let mut replies = Vec::new();
            for control in batch {
                let (park, rx) = Park::new();
                if control.request_park(park) {
                    replies.push(rx);
                }
            }
            let deadline = tokio::time::Instant::now() + PARK_TIMEOUT;
            let mut parked = Vec::new();
            for rx in replies {
                // A connection that ended meanwhile drops its side: skipped.
                if let Ok(Ok(p)) = tokio::time::timeout_at(deadline, rx).await {
                    parked.push(p);
                }
            }
            if parked.is_empty() {
                continue;
            }
            summary.offered += parked.len();
            let (parked, taken) = send(parked).await;
            for p in parked {
                let took = taken.contains(&p.cookie);
                summary.taken += usize::from(took);
                let _ = p.verdict.send(took);
                summary.pauses.push(started.elapsed());
            }
        }
    }
    summary
}

/// A forwarding context with no backend and no instance around it (tests).
#[cfg(test)]
pub(crate) fn test_context(
    mode: crate::data::copy::Mode,
) -> std::sync::Arc<crate::data::forward::ForwardContext> {
    tests::context(mode)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use crate::base::addr::ClientAddr;
    use crate::data::forward::{self, ForwardContext};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio_util::sync::CancellationToken;

    pub(super) fn context(mode: crate::data::copy::Mode) -> Arc<ForwardContext> {
        Arc::new(ForwardContext {
            copy_mode: mode,
            ..ForwardContext::for_tests(&prometheus::Registry::new(), &CancellationToken::new())
        })
    }

    /// An echo server; returns its address.
    async fn echo() -> SocketAddr {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = l.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    /// A proxied pair: the client's end, and the proxy's client and backend sockets.
    async fn pair(backend: SocketAddr) -> (TcpStream, TcpStream, TcpStream, SocketAddr) {
        let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(front.local_addr().unwrap())
            .await
            .unwrap();
        let (proxied, peer) = front.accept().await.unwrap();
        let upstream = TcpStream::connect(backend).await.unwrap();
        (client, proxied, upstream, peer)
    }

    /// Writes a counting sequence of u64s on `client` from `from` and checks it comes back.
    async fn round(client: &mut TcpStream, from: u64, words: u64) {
        let out: Vec<u8> = (from..from + words).flat_map(|w| w.to_be_bytes()).collect();
        let (mut r, mut w) = client.split();
        let write = async { w.write_all(&out).await.unwrap() };
        let mut back = vec![0u8; out.len()];
        let read = async { r.read_exact(&mut back).await.unwrap() };
        tokio::join!(write, read);
        assert!(back == out, "echo differs");
    }

    /// Pending bytes are written first, in each direction; connections that are not taken
    /// resume with nothing lost; taken ones leave the old carrier, and a new one carries on
    /// from their descriptors and pending bytes with the byte sequence intact.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn parked_connections_resume_or_move_without_losing_a_byte() {
        for mode in [
            crate::data::copy::Mode::Buffered,
            crate::data::copy::Mode::Splice,
        ] {
            let backend = echo().await;
            let old = context(mode);
            let (mut client, proxied, upstream, peer) = pair(backend).await;
            // Pending bytes: "up" goes to the echo and comes back after "down".
            let pending = Pending {
                up: 7u64.to_be_bytes().to_vec(),
                down: 6u64.to_be_bytes().to_vec(),
            };
            tokio::spawn(forward::resume(
                proxied,
                upstream,
                ClientAddr(peer),
                pending,
                old.clone(),
            ));
            let mut first = [0u8; 16];
            client.read_exact(&mut first).await.unwrap();
            assert_eq!(
                first[..8],
                6u64.to_be_bytes(),
                "{mode:?}: pending down first"
            );
            assert_eq!(
                first[8..],
                7u64.to_be_bytes(),
                "{mode:?}: pending up echoed"
            );
            round(&mut client, 0, 100_000).await;

            // Not taken: resumes in place.
            let summary =
                hand_over(&old.carried, |parked| async { (parked, HashSet::new()) }).await;
            assert_eq!((summary.offered, summary.taken), (1, 0), "{mode:?}");
            round(&mut client, 100_000, 100_000).await;

            // Taken while stalled with bytes in flight: the client sends but does not read, so
            // the echo fills its receive buffer and the copy towards it blocks mid-burst (for
            // splice: with bytes in the pipe). A new carrier resumes it.
            let new = context(mode);
            let (tx, rx) = oneshot::channel();
            let mut tx = Some(tx);
            const WORDS: u64 = 4_000_000;
            let (mut r, mut w) = client.into_split();
            let write = tokio::spawn(async move {
                let out: Vec<u8> = (200_000u64..200_000 + WORDS)
                    .flat_map(|w| w.to_be_bytes())
                    .collect();
                w.write_all(&out).await.unwrap();
                w
            });
            let counter = old.metrics.bytes_backend_to_client.clone();
            // Stalled: data flowed towards the client, and no more flows.
            let (base, mut last) = (counter.get(), u64::MAX);
            let stalled_by = Instant::now() + Duration::from_secs(20);
            while counter.get() != last || counter.get() < base + (1 << 20) {
                assert!(Instant::now() < stalled_by, "{mode:?}: copy never stalled");
                last = counter.get();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let summary = hand_over(&old.carried, |parked| {
                let tx = tx.take();
                async move {
                    let taken: HashSet<u64> = parked.iter().map(|p| p.cookie).collect();
                    let moved: Vec<_> = parked
                        .iter()
                        .map(|p| {
                            (
                                p.client.try_clone().unwrap(),
                                p.backend.try_clone().unwrap(),
                                p.pending.clone(),
                            )
                        })
                        .collect();
                    let _ = tx.unwrap().send(moved);
                    (parked, taken)
                }
            })
            .await;
            assert_eq!((summary.offered, summary.taken), (1, 1), "{mode:?}");
            for (c, b, pending) in rx.await.unwrap() {
                assert!(
                    !pending.down.is_empty(),
                    "{mode:?}: a stalled copy has bytes in flight"
                );
                let stream = |fd: OwnedFd| {
                    let s = std::net::TcpStream::from(fd);
                    s.set_nonblocking(true).unwrap();
                    TcpStream::from_std(s).unwrap()
                };
                tokio::spawn(forward::resume(
                    stream(c),
                    stream(b),
                    ClientAddr(peer),
                    pending,
                    new.clone(),
                ));
            }
            let mut back = vec![0u8; WORDS as usize * 8];
            r.read_exact(&mut back).await.unwrap();
            let w = write.await.unwrap();
            let ok = back
                .chunks_exact(8)
                .zip(200_000u64..)
                .all(|(b, w)| b == w.to_be_bytes());
            assert!(ok, "{mode:?}: byte sequence broken across the move");
            // The old carrier let go.
            assert!(
                old.carried.is_empty(),
                "{mode:?}: old carrier still registered"
            );
            let mut client = r.reunite(w).unwrap();
            round(&mut client, 5_000_000, 1000).await;
        }
    }
}
