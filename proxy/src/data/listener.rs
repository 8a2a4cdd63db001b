//! The listening sockets this instance holds, and the accept loop on each.
//!
//! A socket may be bound here or received from a peer; several holders then accept from one
//! kernel queue. Sockets are deduplicated by identity, so repeated handoffs never pile up. A
//! shared listener is never `shutdown()` (that would break it for every holder): stopping means
//! no longer accepting and closing our own descriptors.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::base::addr::{ClientAddr, ListenAddr};
use crate::base::lograte::LogRate;
use crate::data::forward::{self, ForwardContext};
use crate::data::metrics::FailReason;
use crate::data::workers::Placement;
use crate::sys::{self, SocketIdentity};

/// One held listening socket, as `/status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ListenerInfo {
    pub address: String,
    pub cookie: u64,
    pub inode: u64,
    /// `bound` here, `shared`/`adopted` from a peer, or `rebound` here after the last socket
    /// for the address could no longer accept.
    pub origin: &'static str,
}

struct Entry {
    addr: ListenAddr,
    identity: SocketIdentity,
    origin: &'static str,
    /// A duplicate kept for sending to peers; the accept task owns the other descriptor.
    fd: OwnedFd,
    stop: CancellationToken,
}

/// The set and whether it is still open to new sockets.
struct Held {
    entries: Vec<Entry>,
    /// Set when draining starts ([`Listeners::freeze`]): from then on no socket is added, so
    /// the set handed to a successor is the whole set (an adoption racing the drain is refused
    /// instead of acknowledged and then closed).
    frozen: bool,
}

/// A duplicate of one held socket, for sending to a peer.
#[derive(Debug)]
pub struct HeldSocket {
    pub addr: ListenAddr,
    pub identity: SocketIdentity,
    pub fd: OwnedFd,
}

/// Why a socket was not taken.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    #[error("draining: no longer taking sockets")]
    Frozen,
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// The listening sockets held by this instance.
pub struct Listeners {
    held: Arc<Mutex<Held>>,
    ctx: Arc<ForwardContext>,
    limit: Arc<Semaphore>,
    /// Whether the accept loops accept; while false, clients wait in the kernel queue.
    accepting: watch::Sender<bool>,
    /// Parent of every accept loop's token.
    stop: CancellationToken,
    /// Which runtime each accept loop (and its connections) runs on.
    placement: Placement,
    /// Connection tasks; drained at shutdown.
    pub connections: TaskTracker,
    accept_loops: TaskTracker,
}

/// A connection taken over from the predecessor of an in-place upgrade, verified and ready to
/// resume.
pub struct TakenConnection {
    pub client: TcpStream,
    pub upstream: TcpStream,
    pub client_addr: ClientAddr,
    /// Bytes the predecessor had read but not written, written first.
    pub pending: crate::data::copy::Pending,
    /// Its `--max-connections` slot.
    pub slot: tokio::sync::OwnedSemaphorePermit,
    /// The runtime whose reactor both sockets are registered with
    /// ([`Listeners::connection_runtime`]), which carries it.
    pub runtime: Handle,
}

impl Listeners {
    /// `stop`: the instance's cancellation tree; every accept loop stops with it.
    pub fn new(
        ctx: Arc<ForwardContext>,
        max_connections: u32,
        placement: Placement,
        stop: CancellationToken,
    ) -> Self {
        Listeners {
            held: Arc::new(Mutex::new(Held {
                entries: Vec::new(),
                frozen: false,
            })),
            ctx,
            limit: Arc::new(Semaphore::new(max_connections as usize)),
            accepting: watch::channel(true).0,
            placement,
            stop,
            connections: TaskTracker::new(),
            accept_loops: TaskTracker::new(),
        }
    }

    /// Starts accepting on `socket` unless the same socket is already held. Returns its
    /// identity and whether it was new. `origin` says where it came from (`bound`, `shared`,
    /// `adopted`). Refused once draining started ([`Self::freeze`]).
    pub fn hold(
        self: &Arc<Self>,
        addr: ListenAddr,
        socket: std::net::TcpListener,
        origin: &'static str,
    ) -> Result<(SocketIdentity, bool), HoldError> {
        let identity = sys::identity(socket.as_fd())?;
        let mut held = self.held.lock().expect("listeners lock");
        if held.frozen {
            return Err(HoldError::Frozen);
        }
        if held.entries.iter().any(|e| e.identity == identity) {
            return Ok((identity, false));
        }
        socket.set_nonblocking(true)?;
        crate::base::net::tune_listener(&socket)?;
        let fd = socket.as_fd().try_clone_to_owned()?;
        // Registered with the reactor of the runtime the loop runs on.
        let runtime = self.placement.next();
        let listener = {
            let _entered = runtime.enter();
            TcpListener::from_std(socket)?
        };
        let stop = self.stop.child_token();
        let accept = accept_loop(AcceptLoop {
            listener,
            addr,
            identity,
            stop: stop.clone(),
            ctx: self.ctx.clone(),
            limit: self.limit.clone(),
            connections: self.connections.clone(),
            accepting: self.accepting.subscribe(),
            held: self.held.clone(),
            owner: Arc::downgrade(self),
        });
        self.accept_loops.spawn_on(accept, &runtime);
        tracing::info!(listen.addr = %addr, cookie = identity.cookie, inode = identity.inode, origin, "listening");
        held.entries.push(Entry {
            addr,
            identity,
            origin,
            fd,
            stop,
        });
        self.ctx
            .metrics
            .listening_sockets
            .set(held.entries.len() as i64);
        Ok((identity, true))
    }

    /// Binds a fresh socket for `addr` (after the last one held for it could no longer accept).
    fn rebind(self: &Arc<Self>, addr: ListenAddr) {
        let bound = crate::base::net::bind_reuseport(addr.0).map_err(HoldError::Io);
        match bound.and_then(|socket| self.hold(addr, socket, "rebound")) {
            Ok(_) => {
                tracing::warn!(listen.addr = %addr, "no socket was left for the address: bound a fresh one")
            }
            Err(e) => {
                tracing::error!(listen.addr = %addr, error = %e, "no socket left for the address, and binding a fresh one failed")
            }
        }
    }

    /// How many sockets to bind fresh per listen address (one per worker thread of
    /// `--runtime per-thread`, else one).
    pub fn sockets_per_address(&self) -> usize {
        self.placement.sockets_per_address()
    }

    /// How many sockets are held for `addr`.
    pub fn count(&self, addr: ListenAddr) -> usize {
        let held = self.held.lock().expect("listeners lock");
        held.entries.iter().filter(|e| e.addr == addr).count()
    }

    /// The address a socket held for `addr` is bound to (its port, when `addr` has port 0).
    pub fn bound_address(&self, addr: ListenAddr) -> Option<std::net::SocketAddr> {
        let held = self.held.lock().expect("listeners lock");
        let entry = held.entries.iter().find(|e| e.addr == addr)?;
        socket2::SockRef::from(&entry.fd)
            .local_addr()
            .ok()?
            .as_socket()
    }

    /// What `/status` shows.
    pub fn info(&self) -> Vec<ListenerInfo> {
        self.held
            .lock()
            .expect("listeners lock")
            .entries
            .iter()
            .map(|e| ListenerInfo {
                address: e.addr.to_string(),
                cookie: e.identity.cookie,
                inode: e.identity.inode,
                origin: e.origin,
            })
            .collect()
    }

    /// Whether draining started (the set is frozen): no socket or connection is taken any more.
    pub fn is_frozen(&self) -> bool {
        self.held.lock().expect("listeners lock").frozen
    }

    /// A connection slot under `--max-connections`, if one is free.
    pub fn connection_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.limit.clone().try_acquire_owned().ok()
    }

    /// The runtime for the next connection taken over from the predecessor of an in-place
    /// upgrade: spread over the worker threads as accepted connections are (the sockets must
    /// be registered with its reactor, under [`Handle::enter`], before
    /// [`Listeners::resume_connection`] runs them there).
    pub fn connection_runtime(&self) -> Handle {
        self.placement.next()
    }

    /// Carries on a connection handed over by the predecessor of an in-place upgrade, on the
    /// runtime its sockets are registered with.
    pub fn resume_connection(&self, taken: TakenConnection) {
        let ctx = self.ctx.clone();
        let TakenConnection {
            client,
            upstream,
            client_addr,
            pending,
            slot,
            runtime,
        } = taken;
        self.connections.spawn_on(
            async move {
                forward::resume(client, upstream, client_addr, pending, ctx).await;
                drop(slot);
            },
            &runtime,
        );
    }

    /// Duplicates of every held socket, for sending to a peer.
    pub fn duplicates(&self) -> io::Result<Vec<HeldSocket>> {
        duplicate(&self.held.lock().expect("listeners lock").entries)
    }

    /// Closes the set to new sockets (draining starts) and returns duplicates of every socket
    /// in it, in one step: whatever was adopted before is in the result, whatever comes after
    /// is refused.
    pub fn freeze(&self) -> io::Result<Vec<HeldSocket>> {
        let mut held = self.held.lock().expect("listeners lock");
        held.frozen = true;
        duplicate(&held.entries)
    }

    /// Lets the accept loops accept (`true`) or leaves clients in the kernel queue (`false`).
    /// Returns whether that changed.
    pub fn set_accepting(&self, accepting: bool) -> bool {
        self.accepting.send_if_modified(|a| {
            let changed = *a != accepting;
            *a = accepting;
            changed
        })
    }

    /// Stops accepting on the sockets with these cookies and closes our descriptors of them
    /// (a peer acknowledged them: it accepts on them now).
    pub fn release(&self, cookies: &[u64]) {
        let mut held = self.held.lock().expect("listeners lock");
        held.entries.retain(|e| {
            let release = cookies.contains(&e.identity.cookie);
            if release {
                e.stop.cancel();
                tracing::info!(listen.addr = %e.addr, cookie = e.identity.cookie, "released to peer");
            }
            !release
        });
        self.ctx
            .metrics
            .listening_sockets
            .set(held.entries.len() as i64);
    }

    /// Stops accepting on every socket and closes our descriptors (never `shutdown()`).
    pub async fn stop_all(&self) {
        let entries: Vec<Entry> = {
            let mut held = self.held.lock().expect("listeners lock");
            held.frozen = true;
            std::mem::take(&mut held.entries)
        };
        for e in &entries {
            e.stop.cancel();
        }
        self.accept_loops.close();
        self.accept_loops.wait().await;
        drop(entries);
        self.ctx.metrics.listening_sockets.set(0);
    }
}

fn duplicate(entries: &[Entry]) -> io::Result<Vec<HeldSocket>> {
    entries
        .iter()
        .map(|e| {
            Ok(HeldSocket {
                addr: e.addr,
                identity: e.identity,
                fd: e.fd.try_clone()?,
            })
        })
        .collect()
}

const BACKOFF_MIN: Duration = Duration::from_millis(5);
const BACKOFF_MAX: Duration = Duration::from_secs(1);
/// Accept failures (a descriptor shortage repeats for every queued client) are logged at most
/// once every 5 s, with the count of those suppressed.
static ACCEPT_FAILED_LOG: LogRate = LogRate::new(Duration::from_secs(5));

/// What an `accept()` error says about the socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptFailure {
    /// The socket can no longer accept (no longer listening, e.g. after someone called
    /// `shutdown()` on the shared socket; not a socket): retrying would spin forever.
    Fatal,
    /// This process is short of descriptors or memory, or one queued connection failed
    /// (aborted, refused by a firewall): later accepts may succeed. Backed off all the same.
    Transient,
}

/// Classifies an `accept()` error. Pure.
pub fn classify_accept_error(e: &io::Error) -> AcceptFailure {
    match e.raw_os_error() {
        Some(libc::EINVAL | libc::EBADF | libc::ENOTSOCK | libc::EOPNOTSUPP | libc::EFAULT) => {
            AcceptFailure::Fatal
        }
        _ => AcceptFailure::Transient,
    }
}

struct AcceptLoop {
    listener: TcpListener,
    addr: ListenAddr,
    identity: SocketIdentity,
    stop: CancellationToken,
    ctx: Arc<ForwardContext>,
    limit: Arc<Semaphore>,
    connections: TaskTracker,
    accepting: watch::Receiver<bool>,
    held: Arc<Mutex<Held>>,
    owner: std::sync::Weak<Listeners>,
}

async fn accept_loop(l: AcceptLoop) {
    let AcceptLoop {
        listener,
        addr,
        identity,
        stop,
        ctx,
        limit,
        connections,
        mut accepting,
        held,
        owner,
    } = l;
    let mut backoff = BACKOFF_MIN;
    loop {
        // While not accepting, clients wait in the kernel queue (for a successor to adopt it).
        tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            r = accepting.wait_for(|a| *a) => if r.is_err() { break },
        }
        let accepted = tokio::select! {
            biased;
            _ = stop.cancelled() => break,
            _ = accepting.wait_for(|a| !*a) => continue,
            r = listener.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                backoff = BACKOFF_MIN;
                ctx.metrics.connections_accepted.inc();
                let Ok(permit) = limit.clone().try_acquire_owned() else {
                    ctx.metrics.connection_failed(FailReason::MaxConnections);
                    drop(stream);
                    continue;
                };
                #[cfg(feature = "planted-faults")]
                if crate::fault::close_accepted() {
                    connections.spawn(crate::fault::close_unanswered(stream));
                    continue;
                }
                let source = if ctx.transparent {
                    transparent_source(peer, addr, &stream)
                } else {
                    None
                };
                let ctx = ctx.clone();
                #[cfg(feature = "planted-faults")]
                if crate::fault::stalls_this_connection() {
                    connections.spawn(async move {
                        tokio::time::sleep(crate::fault::STALL).await;
                        forward::serve(stream, ClientAddr(peer), source, ctx).await;
                        drop(permit);
                    });
                    continue;
                }
                connections.spawn(async move {
                    forward::serve(stream, ClientAddr(peer), source, ctx).await;
                    drop(permit);
                });
            }
            Err(e) if classify_accept_error(&e) == AcceptFailure::Fatal => {
                ctx.metrics.connection_failed(FailReason::AcceptError);
                let orphaned = {
                    let mut held = held.lock().expect("listeners lock");
                    held.entries.retain(|e| e.identity != identity);
                    ctx.metrics.listening_sockets.set(held.entries.len() as i64);
                    ctx.metrics.listening_sockets_dropped.inc();
                    tracing::error!(listen.addr = %addr, cookie = identity.cookie, error = %e, sockets_left = held.entries.len(), "listening socket can no longer accept: dropped");
                    !held.frozen && !held.entries.iter().any(|e| e.addr == addr)
                };
                // The address has no socket left while serving: bind a fresh one rather than
                // leave it dark (every holder of a socket that was shut down lost it at once).
                if orphaned {
                    if let Some(listeners) = owner.upgrade() {
                        listeners.rebind(addr);
                    }
                }
                break;
            }
            Err(e) => {
                ctx.metrics.connection_failed(FailReason::AcceptError);
                if let Some(suppressed) = ACCEPT_FAILED_LOG.allow() {
                    tracing::warn!(listen.addr = %addr, error = %e, suppressed, "accept failed");
                }
                // Every kind of failure backs off: an error that repeats must not spin.
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(BACKOFF_MAX);
            }
        }
    }
    tracing::debug!(listen.addr = %addr, "accept loop stopped");
}

/// The source for a connection from `peer` accepted on `listen` in transparent mode: the
/// node-local test compares with the address the client connected to, which is the listen
/// address unless that is a wildcard (then one `getsockname`).
fn transparent_source(
    peer: std::net::SocketAddr,
    listen: ListenAddr,
    stream: &TcpStream,
) -> Option<std::net::IpAddr> {
    let local = if listen.0.ip().is_unspecified() {
        stream.local_addr().ok()?.ip()
    } else {
        listen.0.ip()
    };
    crate::backends::transparent::source_for(peer.ip(), local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_that_end_a_socket_are_told_apart_from_passing_ones() {
        let err = |n| io::Error::from_raw_os_error(n);
        for n in [libc::EINVAL, libc::EBADF, libc::ENOTSOCK, libc::EOPNOTSUPP] {
            assert_eq!(classify_accept_error(&err(n)), AcceptFailure::Fatal, "{n}");
        }
        for n in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::ENOMEM,
            libc::ECONNABORTED,
            libc::EPERM,
            libc::EPROTO,
        ] {
            assert_eq!(
                classify_accept_error(&err(n)),
                AcceptFailure::Transient,
                "{n}"
            );
        }
    }
}
