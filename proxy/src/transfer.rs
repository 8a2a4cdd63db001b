//! Connection handoff at an in-place upgrade: established client/backend pairs move to the
//! successor with the bytes read but not yet written, and it carries on copying.
//!
//! Every carried connection registers here ([`Registry::register`]). At the upgrade the old
//! instance, after handing over its listening sockets, parks the connections in batches:
//!
//! 1. **Quiesce**: the connection's copy stops in both directions (also in the middle of a
//!    burst) and reports what it had read but not written — for splice, what is in the pipe
//!    ([`crate::copy`]). Nothing more is read from either socket.
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

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

use crate::copy::Pending;
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

/// The connections this instance carries, each reachable for parking.
#[derive(Default)]
pub struct Registry {
    next: AtomicU64,
    conns: Mutex<HashMap<u64, mpsc::Sender<Park>>>,
}

/// Keeps a connection in the registry until dropped.
pub struct Registration {
    registry: Arc<Registry>,
    id: u64,
    pub parks: mpsc::Receiver<Park>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry
            .conns
            .lock()
            .expect("registry lock")
            .remove(&self.id);
    }
}

impl Registry {
    pub fn register(self: &Arc<Self>) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel(1);
        self.conns.lock().expect("registry lock").insert(id, tx);
        Registration {
            registry: self.clone(),
            id,
            parks: rx,
        }
    }

    fn snapshot(&self) -> Vec<(u64, mpsc::Sender<Park>)> {
        self.conns
            .lock()
            .expect("registry lock")
            .iter()
            .map(|(id, tx)| (*id, tx.clone()))
            .collect()
    }

    pub fn len(&self) -> usize {
        self.conns.lock().expect("registry lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
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
pub async fn hand_over<F, Fut>(registry: &Registry, mut send: F) -> Summary
where
    F: FnMut(Vec<Parked>) -> Fut,
    Fut: std::future::Future<Output = (Vec<Parked>, HashSet<u64>)>,
{
    let mut summary = Summary::default();
    let mut seen: HashSet<u64> = HashSet::new();
    for _ in 0..PASSES {
        let fresh: Vec<_> = registry
            .snapshot()
            .into_iter()
            .filter(|(id, _)| seen.insert(*id))
            .collect();
        if fresh.is_empty() {
            break;
        }
        for batch in fresh.chunks(BATCH) {
            let started = Instant::now();
            let mut replies = Vec::new();
            for (_, tx) in batch {
                let (reply, rx) = oneshot::channel();
                if tx.try_send(Park { reply }).is_ok() {
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
