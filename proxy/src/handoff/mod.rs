//! Listener handoff between instances on one node, over Unix sockets in `--handoff-dir`.
//!
//! Every instance serves `<dir>/kap-<pid>-<n>.sock` (0600; the directory 0700). Two exchanges:
//!
//! - **Share** (a new instance, once a backend is healthy): `ShareRequest` → `Sockets` with
//!   duplicates of the peer's listening sockets. Both then accept from one kernel queue.
//! - **Adopt** (a draining instance): `StatusRequest` → `Status`; to a *ready* peer (Serving,
//!   its own backend healthy), `Adopt` with our sockets → `Ack` naming, by `SO_COOKIE`, the
//!   sockets it now accepts on. We stop accepting on exactly those and keep offering the rest.
//!   The receiver takes sockets only until its own drain starts ([`Listeners::freeze`]), so
//!   nothing it acknowledged is missing from what it hands on.
//!
//! Peers are authenticated with `SO_PEERCRED` on both ends (our uid, or `--handoff-allow-uid`).
//! Received sockets are verified (listening TCP, bound to one of our `--listen` addresses) and
//! deduplicated by identity. See `docs/handoff.md`.
//!
//! Layout: [`codec`] (frames, pure), [`wire`] (frames with descriptors on a stream), `server`
//! (the serve loop of a handoff socket, also used by `migrate` and `migrate-back`), `peer` (what
//! an instance answers there).

pub mod codec;
pub mod metrics;
mod peer;
pub(crate) mod server;
pub mod wire;

use std::collections::HashSet;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backends::readiness::Readiness;
use crate::base::addr::ListenAddr;
use crate::data::listener::{HeldSocket, Listeners};
use crate::sys;

use crate::handoff::metrics::{HandoffDirection, HandoffMetrics, HandoffOutcome};
pub use codec::{Message, PeerState};

/// Time one exchange with a peer may take.
pub const EXCHANGE_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest wait for a successor's answer to a `connections` message (see
/// [`Handoff::send_connections`]).
pub const CONNECTIONS_ANSWER_TIMEOUT: Duration = Duration::from_secs(30);
/// Time a successor has to write its `ack` to a `connections` message; it resumes the
/// connections only if the whole answer was written within it.
pub const ACK_WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// Pause between rounds of looking for a Serving peer while draining.
pub const RETRY_INTERVAL: Duration = Duration::from_millis(100);

/// Why the handoff socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    #[error("--handoff-dir {dir}: {message}")]
    Dir { dir: String, message: String },
    #[error("--handoff-dir {dir}: {source}")]
    Io {
        dir: String,
        #[source]
        source: io::Error,
    },
}

/// Listener handoff between instances on one node.
#[derive(Debug, Clone)]
pub struct HandoffConfig {
    /// Directory shared by all instances (0700), holding one Unix socket per instance.
    pub dir: PathBuf,
    /// Uids allowed as peers besides our own.
    pub allow_uids: Vec<u32>,
}

/// The handoff side of one instance.
pub struct Handoff {
    dir: PathBuf,
    path: PathBuf,
    allowed_uids: HashSet<u32>,
    listen: HashSet<ListenAddr>,
    listeners: Arc<Listeners>,
    readiness: Readiness,
    metrics: HandoffMetrics,
    stop: CancellationToken,
    /// Tracks the peer server and each exchange it answers.
    tasks: TaskTracker,
    /// What we last learned of each peer, for `/status`.
    peers: Mutex<Vec<serde_json::Value>>,
    #[cfg(test)]
    hooks: tests::Hooks,
}

impl Handoff {
    /// Prepares the directory, binds our socket and starts serving peers.
    pub fn start(
        config: HandoffConfig,
        listen: Vec<ListenAddr>,
        listeners: Arc<Listeners>,
        readiness: Readiness,
        metrics: HandoffMetrics,
        stop: CancellationToken,
        tasks: TaskTracker,
    ) -> Result<Arc<Self>, HandoffError> {
        let dir = config.dir.clone();
        prepare_dir(&dir)?;
        let uid = nix::unistd::geteuid().as_raw();
        let mut allowed_uids: HashSet<u32> = config.allow_uids.iter().copied().collect();
        allowed_uids.insert(uid);
        let (listener, path) = server::bind(&dir).map_err(|source| HandoffError::Io {
            dir: dir.display().to_string(),
            source,
        })?;

        let handoff = Arc::new(Handoff {
            dir,
            path,
            allowed_uids,
            listen: listen.into_iter().collect(),
            listeners,
            readiness,
            metrics,
            stop,
            tasks,
            peers: Mutex::new(Vec::new()),
            #[cfg(test)]
            hooks: tests::Hooks::default(),
        });
        tracing::info!(socket = %handoff.path.display(), "handoff socket listening");
        handoff.tasks.spawn(server::serve(
            handoff.clone(),
            listener,
            handoff.stop.clone(),
            handoff.tasks.clone(),
        ));
        Ok(handoff)
    }

    /// Stops serving peers and removes our socket file.
    pub fn close(&self) {
        self.stop.cancel();
        let _ = std::fs::remove_file(&self.path);
    }

    /// Asks every live peer for its listening sockets; returns the verified ones: for each
    /// address, every socket the first peer that has one gives (all the members of its
    /// reuseport group).
    pub async fn share_from_peers(&self) -> Vec<(ListenAddr, std::net::TcpListener)> {
        let wanted: Vec<String> = self.listen.iter().map(|a| a.to_string()).collect();
        let mut got: Vec<(ListenAddr, std::net::TcpListener)> = Vec::new();
        for path in self.peer_paths().await {
            let covered: HashSet<ListenAddr> = got.iter().map(|(a, _)| *a).collect();
            if self.listen.iter().all(|a| covered.contains(a)) {
                break;
            }
            let request = Message::ShareRequest {
                addrs: wanted.clone(),
            };
            match self.exchange(&path, &request, &[]).await {
                Ok((Message::Sockets { addrs }, fds)) => {
                    let verified = self.verify(&addrs, fds);
                    let n = verified.len();
                    // Every socket of an address the peers before had not given: all the
                    // members of its reuseport group (one per worker thread of a
                    // `--runtime per-thread` peer).
                    for (addr, socket) in verified {
                        if !covered.contains(&addr) {
                            got.push((addr, socket));
                        }
                    }
                    self.metrics
                        .handoff(HandoffDirection::ShareReceived, HandoffOutcome::Ok);
                    tracing::info!(peer = %path.display(), sockets = n, "handoff: sockets shared by peer");
                }
                Ok((other, _)) => {
                    self.metrics
                        .handoff(HandoffDirection::ShareReceived, HandoffOutcome::Error);
                    tracing::warn!(peer = %path.display(), answer = ?other, "handoff: unexpected answer to share request");
                }
                Err(wire::WireError::Io(e)) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    // A stale socket of a gone instance; already removed.
                }
                Err(e) => {
                    self.metrics
                        .handoff(HandoffDirection::ShareReceived, HandoffOutcome::Error);
                    tracing::warn!(peer = %path.display(), error = %e, "handoff: share request failed");
                }
            }
        }
        got
    }

    /// How many peers say they are ready (Serving, own backend healthy): what a draining
    /// instance looks for before it hands its sockets over. Used by a recovery instance
    /// (`--retire-file`) to know when it can go.
    pub async fn ready_peers(&self) -> usize {
        let mut ready = 0;
        for path in self.peer_paths().await {
            if let Ok((Message::Status { ready: true, .. }, _)) =
                self.exchange(&path, &Message::StatusRequest, &[]).await
            {
                ready += 1;
            }
        }
        ready
    }

    /// What the peer process `pid` says of itself (its state and whether it is ready), when it
    /// serves a handoff socket and answers. Used by the in-place upgrade to wait for the
    /// successor it started.
    pub async fn peer_status(&self, pid: u32) -> Option<(PeerState, bool)> {
        let prefix = format!("kap-{pid}-");
        for path in self.peer_paths().await {
            let named = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix));
            if !named {
                continue;
            }
            if let Ok((
                Message::Status {
                    pid: p,
                    state,
                    ready,
                },
                _,
            )) = self.exchange(&path, &Message::StatusRequest, &[]).await
            {
                if p == pid {
                    return Some((state, ready));
                }
            }
        }
        None
    }

    /// Whether another instance on the node says it is ready (Serving with its own backend
    /// healthy: one we could hand our sockets to). `/peer-ready` answers it for the preStop
    /// hook of a pod that is being deleted.
    pub async fn ready_peer(&self) -> bool {
        for path in self.peer_paths().await {
            if let Ok((Message::Status { ready: true, .. }, _)) =
                self.exchange(&path, &Message::StatusRequest, &[]).await
            {
                return true;
            }
        }
        false
    }

    /// In-place upgrade: offers `parked` connections to the successor `pid`; returns them with
    /// the client-socket cookies it acknowledged (empty on any failure: they resume here).
    ///
    /// The answer is awaited until it arrives or the successor closes the connection: the
    /// successor resumes a connection only after its `ack` is written, and bounds its own side
    /// (it drops everything it received when it cannot answer in time), so an exchange that
    /// ends without an `ack` means nothing was taken. Only a successor that hangs for
    /// [`CONNECTIONS_ANSWER_TIMEOUT`] is given up on.
    pub async fn send_connections(
        &self,
        pid: u32,
        parked: Vec<crate::data::transfer::Parked>,
    ) -> (Vec<crate::data::transfer::Parked>, HashSet<u64>) {
        let prefix = format!("kap-{pid}-");
        let Some(path) = self.peer_paths().await.into_iter().find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        }) else {
            tracing::warn!(
                successor.pid = pid,
                "handoff: successor's socket not found; connections stay"
            );
            return (parked, HashSet::new());
        };
        let conns = parked
            .iter()
            .map(|p| codec::ConnEntry {
                client: p.client_addr.to_string(),
                up: p.pending.up.len() as u32,
                down: p.pending.down.len() as u32,
            })
            .collect();
        let mut tail = Vec::new();
        for p in &parked {
            tail.extend_from_slice(&p.pending.up);
            tail.extend_from_slice(&p.pending.down);
        }
        let fds: Vec<_> = parked
            .iter()
            .flat_map(|p| [p.client.as_fd(), p.backend.as_fd()])
            .collect();
        let msg = Message::Connections { conns };
        let result = async {
            let stream = self.connect_peer(&path).await?;
            tokio::time::timeout(
                EXCHANGE_TIMEOUT,
                wire::send_with_tail(&stream, &msg, &fds, &tail),
            )
            .await
            .map_err(|_| wire::WireError::Timeout)??;
            tokio::time::timeout(CONNECTIONS_ANSWER_TIMEOUT, wire::recv(&stream))
                .await
                .map_err(|_| wire::WireError::Timeout)?
        }
        .await;
        drop(fds);
        let taken = match result {
            Ok((Message::Ack { cookies }, _)) => {
                self.metrics
                    .handoff(HandoffDirection::ConnectionsSent, HandoffOutcome::Ok);
                cookies.into_iter().collect()
            }
            Ok((other, _)) => {
                self.metrics
                    .handoff(HandoffDirection::ConnectionsSent, HandoffOutcome::Refused);
                tracing::info!(successor.pid = pid, answer = ?other, "handoff: successor did not take connections");
                HashSet::new()
            }
            Err(e) => {
                self.metrics
                    .handoff(HandoffDirection::ConnectionsSent, HandoffOutcome::Error);
                tracing::warn!(successor.pid = pid, error = %e, "handoff: sending connections failed; they stay");
                HashSet::new()
            }
        };
        (parked, taken)
    }

    /// Connects to a peer's socket and checks its credentials.
    async fn connect_peer(&self, path: &Path) -> Result<tokio::net::UnixStream, wire::WireError> {
        let stream = tokio::time::timeout(EXCHANGE_TIMEOUT, tokio::net::UnixStream::connect(path))
            .await
            .map_err(|_| wire::WireError::Timeout)??;
        self.check_peer(path, &stream)?;
        Ok(stream)
    }

    /// The credentials of the peer at `path`, if its uid is allowed.
    fn check_peer(
        &self,
        path: &Path,
        stream: &tokio::net::UnixStream,
    ) -> Result<nix::sys::socket::UnixCredentials, wire::WireError> {
        let cred = sys::peer_credentials(stream.as_fd())?;
        if !self.allowed_uids.contains(&cred.uid()) {
            self.metrics.peers_refused.inc();
            tracing::warn!(peer = %path.display(), uid = cred.uid(), "handoff: peer socket owned by a uid not allowed");
            return Err(
                io::Error::new(io::ErrorKind::PermissionDenied, "peer uid not allowed").into(),
            );
        }
        Ok(cred)
    }

    /// Draining: offers our sockets to a ready peer until peers have acknowledged all of them
    /// or `deadline` passes. Meanwhile the sockets not yet taken are accepted on only while
    /// `usable()` says a backend can serve: otherwise clients wait in the kernel queue for the
    /// successor that will adopt the socket. Returns whether peers took every socket.
    pub async fn hand_over(&self, deadline: Instant, usable: impl Fn() -> bool) -> bool {
        // From here on the set no longer grows (adoption is refused): this is all of it.
        let mut remaining: Vec<HeldSocket> = match self.listeners.freeze() {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "handoff: cannot duplicate listening sockets");
                return false;
            }
        };
        if remaining.is_empty() {
            return true;
        }
        let mut first_round = true;
        loop {
            for path in self.peer_paths().await {
                match self.offer(&path, &remaining).await {
                    Ok(acked) if !acked.is_empty() => {
                        remaining.retain(|s| !acked.contains(&s.identity.cookie));
                        self.listeners.release(&acked);
                        self.metrics
                            .handoff(HandoffDirection::AdoptSent, HandoffOutcome::Ok);
                        tracing::info!(peer = %path.display(), sockets = acked.len(), left = remaining.len(), "handoff: listening sockets adopted by peer");
                        if remaining.is_empty() {
                            return true;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        self.metrics
                            .handoff(HandoffDirection::AdoptSent, HandoffOutcome::Error);
                        tracing::debug!(peer = %path.display(), error = %e, "handoff: offer failed");
                    }
                }
            }
            let accept = usable();
            if self.listeners.set_accepting(accept) || first_round {
                if accept {
                    tracing::info!("handoff: no ready peer yet; accepting while a backend is usable and looking for one");
                } else {
                    tracing::info!("handoff: no ready peer and no usable backend; not accepting (clients wait in the kernel queue for a successor)");
                }
                first_round = false;
            }
            if Instant::now() + RETRY_INTERVAL >= deadline {
                self.listeners.set_accepting(true);
                self.metrics
                    .handoff(HandoffDirection::AdoptSent, HandoffOutcome::NoPeer);
                tracing::warn!(
                    sockets = remaining.len(),
                    "handoff: no ready peer before the drain deadline; closing listeners"
                );
                return false;
            }
            tokio::time::sleep(RETRY_INTERVAL).await;
        }
    }

    /// One offer to one peer: the cookies of the offered sockets it acknowledged (empty when it
    /// is not ready or refused).
    async fn offer(&self, path: &Path, held: &[HeldSocket]) -> Result<Vec<u64>, wire::WireError> {
        let (status, _) = self.exchange(path, &Message::StatusRequest, &[]).await?;
        let Message::Status { ready: true, .. } = status else {
            return Ok(Vec::new());
        };
        let addrs: Vec<String> = held.iter().map(|s| s.addr.to_string()).collect();
        let fds: Vec<_> = held.iter().map(|s| s.fd.as_fd()).collect();
        match self.exchange(path, &Message::Adopt { addrs }, &fds).await? {
            (Message::Ack { cookies }, _) => Ok(held
                .iter()
                .map(|s| s.identity.cookie)
                .filter(|c| cookies.contains(c))
                .collect()),
            (Message::Refuse { reason }, _) => {
                tracing::info!(peer = %path.display(), reason, "handoff: peer refused adoption");
                Ok(Vec::new())
            }
            _ => Ok(Vec::new()),
        }
    }

    /// Connects to a peer, checks its credentials, sends one message, reads one answer.
    async fn exchange(
        &self,
        path: &Path,
        msg: &Message,
        fds: &[std::os::fd::BorrowedFd<'_>],
    ) -> Result<(Message, Vec<OwnedFd>), wire::WireError> {
        let work = async {
            let stream = match tokio::net::UnixStream::connect(path).await {
                Ok(s) => s,
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    // Nobody listens: the instance is gone (sockets are renamed into place only
                    // once listening, so this is never one that is starting).
                    tracing::info!(socket = %path.display(), "handoff: removing stale peer socket");
                    let stale = path.to_path_buf();
                    self.tasks
                        .spawn_blocking(move || std::fs::remove_file(stale));
                    return Err(e.into());
                }
                Err(e) => return Err(e.into()),
            };
            let cred = self.check_peer(path, &stream)?;
            wire::send(&stream, msg, fds).await?;
            let answer = wire::recv(&stream).await?;
            self.remember_peer(path, &answer.0, cred.pid());
            Ok(answer)
        };
        match tokio::time::timeout(EXCHANGE_TIMEOUT, work).await {
            Ok(r) => r,
            Err(_) => Err(wire::WireError::Timeout),
        }
    }

    fn remember_peer(&self, path: &Path, answer: &Message, pid: i32) {
        let last = match answer {
            Message::Status { state, ready, .. } => format!("status {state}, ready {ready}"),
            Message::Sockets { addrs } => format!("shared {} sockets", addrs.len()),
            Message::Ack { cookies } => format!("adopted {} sockets", cookies.len()),
            Message::Refuse { reason } => format!("refused: {reason}"),
            other => format!("{other:?}"),
        };
        let mut peers = self.peers.lock().expect("peers lock");
        let socket = path.display().to_string();
        peers.retain(|p| p["socket"] != socket.as_str());
        peers.push(serde_json::json!({ "socket": socket, "pid": pid, "last_exchange": last }));
    }

    /// Peer socket files in the directory, ours excluded. The directory is read on the
    /// blocking pool (a draining instance reads it every 100 ms).
    async fn peer_paths(&self) -> Vec<PathBuf> {
        let (dir, own) = (self.dir.clone(), self.path.clone());
        let read = self.tasks.spawn_blocking(move || {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                return Vec::new();
            };
            let mut paths: Vec<PathBuf> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| {
                    p != &own
                        && p.file_name()
                            .and_then(|n| n.to_str())
                            .is_some_and(|n| n.starts_with("kap-") && n.ends_with(".sock"))
                })
                .collect();
            paths.sort();
            paths
        });
        read.await.unwrap_or_default()
    }

    /// Turns received descriptors into listeners we may use: listening TCP sockets bound to one
    /// of our `--listen` addresses, matching the address announced for them. Others are closed.
    fn verify(
        &self,
        addrs: &[String],
        fds: Vec<OwnedFd>,
    ) -> Vec<(ListenAddr, std::net::TcpListener)> {
        let mut out = Vec::new();
        for (announced, fd) in addrs.iter().zip(fds) {
            match sys::listening_tcp_addr(fd.as_fd()) {
                Ok(actual)
                    if self.listen.contains(&ListenAddr(actual))
                        && announced.parse().ok() == Some(actual) =>
                {
                    out.push((ListenAddr(actual), std::net::TcpListener::from(fd)));
                }
                Ok(actual) => {
                    self.metrics.messages_rejected.inc();
                    tracing::warn!(announced, actual = %actual, "handoff: received socket is not one of our --listen addresses; closed");
                }
                Err(e) => {
                    self.metrics.messages_rejected.inc();
                    tracing::warn!(announced, error = %e, "handoff: received descriptor is not a listening TCP socket; closed");
                }
            }
        }
        out
    }

    /// Peers as last seen, for `/status`.
    pub fn peers_json(&self) -> serde_json::Value {
        serde_json::Value::Array(self.peers.lock().expect("peers lock").clone())
    }
}

#[cfg(test)]
mod tests;

/// Checks an existing handoff directory without changing anything (used while validating the
/// configuration, before anything is bound): a missing one is fine, it is created at start.
pub fn check_dir(dir: &Path) -> Result<(), HandoffError> {
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        _ => prepare_dir(dir),
    }
}

/// Creates the directory 0700 if missing; refuses a non-directory, a symlink, or a directory
/// writable by group or others, or owned by another uid than ours or root.
fn prepare_dir(dir: &Path) -> Result<(), HandoffError> {
    let err = |message: String| HandoffError::Dir {
        dir: dir.display().to_string(),
        message,
    };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| err(format!("cannot create: {e}")))?;
        }
        Err(e) => return Err(err(e.to_string())),
        Ok(meta) => {
            if meta.file_type().is_symlink() {
                return Err(err("is a symbolic link".into()));
            }
            if !meta.is_dir() {
                return Err(err("is not a directory".into()));
            }
            if meta.mode() & 0o022 != 0 {
                return Err(err(format!(
                    "mode {:o} lets other users replace sockets (use 0700)",
                    meta.mode() & 0o7777
                )));
            }
            let uid = nix::unistd::geteuid().as_raw();
            if meta.uid() != uid && meta.uid() != 0 {
                return Err(err(format!(
                    "owned by uid {}, not by us ({uid}) or root",
                    meta.uid()
                )));
            }
        }
    }
    Ok(())
}
