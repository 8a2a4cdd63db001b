//! The one serve loop of a handoff socket, shared by proxy instances ([`super::Handoff`]) and
//! the `migrate` and `migrate-back` commands, which serve a socket like an instance's.
//!
//! The loop creates the socket file, accepts peers, checks each one's credentials, reads one
//! request within [`EXCHANGE_TIMEOUT`], answers `StatusRequest` itself and hands the other
//! requests to a [`Responder`]: what differs between the servers (who may connect, the state
//! they report, which sockets they offer, what an adoption or a connection handover does).

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::codec::{ConnEntry, Message, PeerState};
use super::{wire, EXCHANGE_TIMEOUT};
use crate::sys;

/// Pause after a failed `accept` (descriptors exhausted, say) before the next one.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// Binds `<dir>/kap-<pid>-<n>.sock` (0600) under a temporary name, listens, then renames it
/// into place: a peer never sees a socket file that refuses connections (which it would take
/// for stale). Needs a tokio runtime.
pub(crate) fn bind(dir: &Path) -> io::Result<(UnixListener, PathBuf)> {
    let name = format!("kap-{}-{}.sock", std::process::id(), rand::random::<u32>());
    let path = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    let listener = std::os::unix::net::UnixListener::bind(&tmp)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    std::fs::rename(&tmp, &path)?;
    Ok((UnixListener::from_std(listener)?, path))
}

/// Why a handoff directory prepared for another uid (the proxies', by `migrate` and
/// `migrate-back` running as root) is not fit.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("--handoff-dir {}", .dir.display())]
    Unreadable {
        dir: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("--handoff-dir {}: not a directory", .dir.display())]
    NotADirectory { dir: PathBuf },
    #[error(
        "--handoff-dir {}: must belong to uid {uid} with mode 0700 (it is {owner}, {mode:o}); see manifests/node/tmpfiles.d",
        .dir.display()
    )]
    Ownership {
        dir: PathBuf,
        uid: u32,
        owner: u32,
        mode: u32,
    },
}

/// The proxies' handoff directory must be a directory of `uid`, writable by nobody else.
pub(crate) fn check_dir_of(dir: &Path, uid: u32) -> Result<(), DirError> {
    let meta = std::fs::symlink_metadata(dir).map_err(|source| DirError::Unreadable {
        dir: dir.to_owned(),
        source,
    })?;
    if !meta.is_dir() || meta.file_type().is_symlink() {
        return Err(DirError::NotADirectory {
            dir: dir.to_owned(),
        });
    }
    if meta.uid() != uid || meta.mode() & 0o022 != 0 {
        return Err(DirError::Ownership {
            dir: dir.to_owned(),
            uid,
            owner: meta.uid(),
            mode: meta.mode() & 0o7777,
        });
    }
    Ok(())
}

/// A connected peer whose credentials were checked; cheap to clone (an answer may be written
/// after the exchange, see [`Responder::connections`]).
#[derive(Clone)]
pub(crate) struct Peer {
    stream: Arc<UnixStream>,
    /// The peer's process id (`SO_PEERCRED`), for logs.
    pub(crate) pid: i32,
}

impl Peer {
    /// Sends one message; `fds` travel with it.
    pub(crate) async fn send(
        &self,
        msg: &Message,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), wire::WireError> {
        wire::send(&self.stream, msg, fds).await
    }

    /// Sends listening sockets: `Sockets` naming each address, its descriptor beside.
    pub(crate) async fn send_sockets(
        &self,
        sockets: &[(String, BorrowedFd<'_>)],
    ) -> Result<(), wire::WireError> {
        let addrs = sockets.iter().map(|(a, _)| a.clone()).collect();
        let fds: Vec<BorrowedFd<'_>> = sockets.iter().map(|(_, fd)| *fd).collect();
        self.send(&Message::Sockets { addrs }, &fds).await
    }
}

/// What a handler did with a request.
pub(crate) enum Reply {
    /// Answer with this message (no descriptors).
    Answer(Message),
    /// The handler wrote its answer itself (descriptors, or work after the answer).
    Answered,
    /// This server does not serve such requests: answered by [`Responder::refuse`].
    NotServed,
}

/// What differs between the servers of a handoff socket. The requests a server does not
/// serve keep the default handlers, which leave them to [`Responder::refuse`].
pub(crate) trait Responder: Send + Sync + 'static {
    /// Prefix of the server's log lines (`handoff`, `migrate`, `migrate-back`).
    const NAME: &'static str;

    /// Whether a peer running as `uid` may talk to us.
    fn allows(&self, uid: u32) -> bool;

    /// A peer was refused (credentials unreadable, uid not allowed).
    fn peer_refused(&self) {}

    /// A peer's message was rejected (malformed, unexpected, or too slow).
    fn message_rejected(&self) {}

    /// Our answer to `StatusRequest`: the state we report and whether we are ready (may be
    /// handed sockets).
    fn status(&self) -> (PeerState, bool);

    /// `ShareRequest` for `asked` addresses.
    fn share(&self, peer: &Peer, asked: &[String]) -> impl Future<Output = Reply> + Send {
        let _ = (peer, asked);
        async { Reply::NotServed }
    }

    /// `Adopt`: a draining peer offers its listening sockets, `fds` in the order of `addrs`.
    fn adopt(
        &self,
        peer: &Peer,
        addrs: &[String],
        fds: Vec<OwnedFd>,
    ) -> impl Future<Output = Reply> + Send {
        let _ = (peer, addrs, fds);
        async { Reply::NotServed }
    }

    /// `Connections`: a predecessor offers established connections (two descriptors each) and
    /// their pending bytes (`tail`).
    fn connections(
        &self,
        peer: &Peer,
        conns: &[ConnEntry],
        fds: Vec<OwnedFd>,
        tail: &[u8],
    ) -> Reply {
        let _ = (peer, conns, fds, tail);
        Reply::NotServed
    }

    /// The answer to a request this server does not serve.
    fn refuse(&self, pid: i32, request: &Message) -> Message;
}

/// Accepts peers on `listener` until `stop`; each exchange runs as a task of `tasks`, bounded
/// by [`EXCHANGE_TIMEOUT`].
pub(crate) async fn serve<R: Responder>(
    responder: Arc<R>,
    listener: UnixListener,
    stop: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "{}: accept failed", R::NAME);
                    tokio::time::sleep(ACCEPT_RETRY).await;
                    continue;
                }
            },
        };
        let responder = responder.clone();
        tasks.spawn(async move {
            if tokio::time::timeout(EXCHANGE_TIMEOUT, exchange(&*responder, stream))
                .await
                .is_err()
            {
                responder.message_rejected();
                tracing::warn!("{}: peer too slow; connection closed", R::NAME);
            }
        });
    }
}

/// One connection: credentials, one request, its answer.
async fn exchange<R: Responder>(responder: &R, stream: UnixStream) {
    let cred = match sys::peer_credentials(stream.as_fd()) {
        Ok(c) => c,
        Err(e) => {
            responder.peer_refused();
            tracing::warn!(error = %e, "{}: cannot read peer credentials; refused", R::NAME);
            return;
        }
    };
    if !responder.allows(cred.uid()) {
        responder.peer_refused();
        tracing::warn!(
            peer.pid = cred.pid(),
            peer.uid = cred.uid(),
            "{}: peer uid not allowed; refused",
            R::NAME
        );
        return;
    }
    let (request, fds, tail) = match wire::recv_with_tail(&stream).await {
        Ok(m) => m,
        Err(e) => {
            responder.message_rejected();
            tracing::warn!(peer.pid = cred.pid(), error = %e, "{}: bad message rejected", R::NAME);
            return;
        }
    };
    let peer = Peer {
        stream: Arc::new(stream),
        pid: cred.pid(),
    };
    let reply = match &request {
        Message::StatusRequest => {
            let (state, ready) = responder.status();
            Reply::Answer(Message::Status {
                pid: std::process::id(),
                state,
                ready,
            })
        }
        Message::ShareRequest { addrs } => responder.share(&peer, addrs).await,
        Message::Adopt { addrs } => responder.adopt(&peer, addrs, fds).await,
        Message::Connections { conns } => responder.connections(&peer, conns, fds, &tail),
        _ => Reply::NotServed,
    };
    let answer = match reply {
        Reply::Answer(m) => m,
        Reply::NotServed => responder.refuse(peer.pid, &request),
        Reply::Answered => return,
    };
    if let Err(e) = peer.send(&answer, &[]).await {
        tracing::debug!(error = %e, "{}: cannot answer peer", R::NAME);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Serves status only, to one uid; counts refused peers.
    struct StatusOnly {
        uid: u32,
        refused: AtomicUsize,
    }

    impl Responder for StatusOnly {
        const NAME: &'static str = "test";

        fn allows(&self, uid: u32) -> bool {
            uid == self.uid
        }

        fn peer_refused(&self) {
            self.refused.fetch_add(1, Ordering::SeqCst);
        }

        fn status(&self) -> (PeerState, bool) {
            (PeerState::Other("Testing".into()), true)
        }

        fn refuse(&self, _pid: i32, _request: &Message) -> Message {
            Message::Refuse {
                reason: "status only".into(),
            }
        }
    }

    async fn ask(path: &Path, msg: &Message) -> Result<Message, wire::WireError> {
        let stream = UnixStream::connect(path).await?;
        wire::send(&stream, msg, &[]).await?;
        Ok(wire::recv(&stream).await?.0)
    }

    /// The loop answers status itself, leaves the rest to the responder (an unserved request
    /// is refused), and closes on a peer whose uid is not allowed without reading it.
    #[tokio::test]
    async fn answers_status_refuses_the_unserved_and_closes_on_strangers() {
        let dir =
            std::env::temp_dir().join(format!("kap-server-unit-{:016x}", rand::random::<u64>()));
        std::fs::create_dir(&dir).unwrap();
        let (listener, path) = bind(&dir).unwrap();
        let mode = std::fs::metadata(&path).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let me = nix::unistd::geteuid().as_raw();
        let responder = Arc::new(StatusOnly {
            uid: me,
            refused: AtomicUsize::new(0),
        });
        let (stop, tasks) = (CancellationToken::new(), TaskTracker::new());
        let server = tokio::spawn(serve(
            responder.clone(),
            listener,
            stop.clone(),
            tasks.clone(),
        ));

        let status = ask(&path, &Message::StatusRequest).await.unwrap();
        assert_eq!(
            status,
            Message::Status {
                pid: std::process::id(),
                state: PeerState::Other("Testing".into()),
                ready: true
            }
        );
        let refused = ask(&path, &Message::ShareRequest { addrs: vec![] })
            .await
            .unwrap();
        assert_eq!(
            refused,
            Message::Refuse {
                reason: "status only".into()
            }
        );
        assert_eq!(responder.refused.load(Ordering::SeqCst), 0);

        // The same server, now allowing another uid only.
        stop.cancel();
        server.await.unwrap();
        let (listener, path2) = bind(&dir).unwrap();
        let stranger = Arc::new(StatusOnly {
            uid: me.wrapping_add(1),
            refused: AtomicUsize::new(0),
        });
        let stop = CancellationToken::new();
        tokio::spawn(serve(
            stranger.clone(),
            listener,
            stop.clone(),
            tasks.clone(),
        ));
        let closed = ask(&path2, &Message::StatusRequest).await;
        // Closed unread: an end of stream, or a reset since our request was not read.
        let unanswered = match &closed {
            Err(wire::WireError::Closed) => true,
            Err(wire::WireError::Io(e)) => e.kind() == io::ErrorKind::ConnectionReset,
            _ => false,
        };
        assert!(unanswered, "{closed:?}");
        assert_eq!(stranger.refused.load(Ordering::SeqCst), 1);
        stop.cancel();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
