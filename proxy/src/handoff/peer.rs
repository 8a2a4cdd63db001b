//! What a proxy instance answers on its handoff socket ([`Responder`] for [`Handoff`]): its
//! lifecycle state, duplicates of its listening sockets, adoption of a draining peer's sockets,
//! and the established connections of a predecessor upgrading in place.

use std::os::fd::{AsFd, OwnedFd};

use super::codec::{ConnEntry, Message, PeerState};
use super::server::{Peer, Reply, Responder};
use super::Handoff;
use crate::base::lifecycle::State;
use crate::data::listener::{HoldError, TakenConnection};
use crate::handoff::metrics::{HandoffDirection, HandoffOutcome};
use crate::sys;

impl Responder for Handoff {
    const NAME: &'static str = "handoff";

    fn allows(&self, uid: u32) -> bool {
        self.allowed_uids.contains(&uid)
    }

    fn peer_refused(&self) {
        self.metrics.peers_refused.inc();
    }

    fn message_rejected(&self) {
        self.metrics.messages_rejected.inc();
    }

    fn status(&self) -> (PeerState, bool) {
        (self.readiness.state().into(), self.readiness.ready())
    }

    async fn share(&self, peer: &Peer, asked: &[String]) -> Reply {
        share(self, peer, self.readiness.state(), asked).await;
        Reply::Answered
    }

    async fn adopt(&self, peer: &Peer, addrs: &[String], fds: Vec<OwnedFd>) -> Reply {
        Reply::Answer(adopt(self, self.readiness.state(), addrs, fds, peer.pid).await)
    }

    fn connections(
        &self,
        peer: &Peer,
        conns: &[ConnEntry],
        fds: Vec<OwnedFd>,
        tail: &[u8],
    ) -> Reply {
        let state = self.readiness.state();
        match take_connections(self, state, conns, fds, tail, peer.pid) {
            Ok(taken) => {
                commit_connections(self, peer.clone(), taken);
                Reply::Answered
            }
            Err(e) => Reply::Answer(Message::Refuse {
                reason: e.to_string(),
            }),
        }
    }

    fn refuse(&self, pid: i32, request: &Message) -> Message {
        self.metrics.messages_rejected.inc();
        tracing::warn!(peer.pid = pid, message = ?request, "handoff: unexpected message rejected");
        Message::Refuse {
            reason: "unexpected message".into(),
        }
    }
}

/// Sends duplicates of our sockets for the asked addresses (while Serving or Draining).
async fn share(handoff: &Handoff, peer: &Peer, state: State, asked: &[String]) {
    let pid = peer.pid;
    let held = if matches!(state, State::Serving | State::Draining) {
        handoff.listeners.duplicates().unwrap_or_default()
    } else {
        Vec::new()
    };
    let give: Vec<_> = held
        .into_iter()
        .filter(|s| asked.iter().any(|a| *a == s.addr.to_string()))
        .collect();
    let sockets: Vec<_> = give
        .iter()
        .map(|s| (s.addr.to_string(), s.fd.as_fd()))
        .collect();
    match peer.send_sockets(&sockets).await {
        Ok(()) => {
            handoff
                .metrics
                .handoff(HandoffDirection::ShareSent, HandoffOutcome::Ok);
            tracing::info!(
                peer.pid = pid,
                sockets = sockets.len(),
                "handoff: shared listening sockets with peer"
            );
        }
        Err(e) => {
            handoff
                .metrics
                .handoff(HandoffDirection::ShareSent, HandoffOutcome::Error);
            tracing::warn!(peer.pid = pid, error = %e, "handoff: sharing failed");
        }
    }
}

/// Takes over a draining peer's sockets (only while Serving, and only until our own drain
/// starts: [`crate::data::listener::Listeners::hold`] refuses once the set is frozen, so an adoption
/// racing our drain is refused rather than acknowledged and then closed).
async fn adopt(
    handoff: &Handoff,
    state: State,
    addrs: &[String],
    fds: Vec<OwnedFd>,
    pid: i32,
) -> Message {
    if state != State::Serving {
        handoff
            .metrics
            .handoff(HandoffDirection::AdoptReceived, HandoffOutcome::Refused);
        return Message::Refuse {
            reason: format!("not serving ({state})"),
        };
    }
    #[cfg(test)]
    handoff.hooks.after_state_read().await;
    // Acknowledge exactly the sockets we now accept on (newly held, or held already because
    // they were shared with us at start), by cookie: the peer closes only those.
    let mut fresh = 0;
    let mut cookies = Vec::new();
    let mut frozen = false;
    for (addr, socket) in handoff.verify(addrs, fds) {
        #[cfg(test)]
        if handoff.hooks.fail_hold() {
            continue;
        }
        match handoff.listeners.hold(addr, socket, "adopted") {
            Ok((identity, new)) => {
                fresh += usize::from(new);
                cookies.push(identity.cookie);
            }
            Err(HoldError::Frozen) => frozen = true,
            Err(e) => {
                tracing::warn!(listen.addr = %addr, error = %e, "handoff: cannot accept on adopted socket")
            }
        }
    }
    if frozen && cookies.is_empty() {
        handoff
            .metrics
            .handoff(HandoffDirection::AdoptReceived, HandoffOutcome::Refused);
        return Message::Refuse {
            reason: "draining".into(),
        };
    }
    handoff
        .metrics
        .handoff(HandoffDirection::AdoptReceived, HandoffOutcome::Ok);
    tracing::info!(
        peer.pid = pid,
        offered = addrs.len(),
        taken = cookies.len(),
        new = fresh,
        "handoff: adopted peer's listening sockets"
    );
    Message::Ack { cookies }
}

/// Connections verified and ready to resume once the `ack` naming them is written.
struct Taken {
    cookies: Vec<u64>,
    conns: Vec<TakenConnection>,
    offered: usize,
}

/// Verifies the connections a predecessor hands over (only while Serving and before our own
/// drain): the client socket must be a connected TCP socket on one of our `--listen`
/// addresses, the backend socket a connected TCP socket, and a connection slot must be free.
/// The others are closed here (our duplicates only) and stay with the predecessor.
fn take_connections(
    handoff: &Handoff,
    state: State,
    conns: &[ConnEntry],
    fds: Vec<OwnedFd>,
    tail: &[u8],
    pid: i32,
) -> Result<Taken, NotServing> {
    if state != State::Serving || handoff.listeners.is_frozen() {
        handoff.metrics.handoff(
            HandoffDirection::ConnectionsReceived,
            HandoffOutcome::Refused,
        );
        return Err(NotServing(state));
    }
    let mut fds = fds.into_iter();
    let mut offset = 0;
    let mut taken = Taken {
        cookies: Vec::new(),
        conns: Vec::new(),
        offered: conns.len(),
    };
    for entry in conns {
        let (Some(client), Some(backend)) = (fds.next(), fds.next()) else {
            break;
        };
        let up = tail[offset..offset + entry.up as usize].to_vec();
        offset += entry.up as usize;
        let down = tail[offset..offset + entry.down as usize].to_vec();
        offset += entry.down as usize;
        // On one of our --listen addresses (a wildcard one: any address, that port).
        let ours = |local: &std::net::SocketAddr| {
            handoff
                .listen
                .iter()
                .any(|l| l.0 == *local || (l.0.ip().is_unspecified() && l.0.port() == local.port()))
        };
        let client_ok = sys::connected_tcp_addrs(client.as_fd())
            .ok()
            .filter(|(local, _)| ours(local));
        let backend_ok = sys::connected_tcp_addrs(backend.as_fd()).is_ok();
        let (Some((_, peer)), true) = (client_ok, backend_ok) else {
            handoff.metrics.messages_rejected.inc();
            tracing::warn!(peer.pid = pid, client = entry.client, "handoff: received connection is not a connected TCP pair on our --listen address; left to the predecessor");
            continue;
        };
        let Some(slot) = handoff.listeners.connection_slot() else {
            tracing::warn!(
                peer.pid = pid,
                client = entry.client,
                "handoff: --max-connections reached; connection left to the predecessor"
            );
            continue;
        };
        let Ok(identity) = sys::identity(client.as_fd()) else {
            continue;
        };
        // Registered with the reactor of the runtime that will carry it (a worker thread's,
        // with a runtime per thread), as accepted connections are.
        let runtime = handoff.listeners.connection_runtime();
        let stream = |fd: std::os::fd::OwnedFd| {
            let s = std::net::TcpStream::from(fd);
            s.set_nonblocking(true)?;
            let _entered = runtime.enter();
            tokio::net::TcpStream::from_std(s)
        };
        let (Ok(client), Ok(upstream)) = (stream(client), stream(backend)) else {
            continue;
        };
        taken.cookies.push(identity.cookie);
        taken.conns.push(TakenConnection {
            client,
            upstream,
            client_addr: crate::base::addr::ClientAddr(peer),
            pending: crate::data::copy::Pending { up, down },
            slot,
            runtime,
        });
    }
    Ok(taken)
}

/// Connections offered while this instance does not serve (or its listeners are frozen for
/// an upgrade): refused, they stay with the predecessor.
#[derive(Debug, thiserror::Error)]
#[error("not serving ({0})")]
struct NotServing(State);

/// Writes the `ack` and, only once all of it is written, resumes the connections it names.
/// Runs apart from the exchange's own deadline, bounded by [`super::ACK_WRITE_TIMEOUT`]: when
/// the answer cannot be written in time everything is dropped (our duplicates closed) and the
/// predecessor, which sees no `ack`, resumes the connections itself.
fn commit_connections(handoff: &Handoff, peer: Peer, taken: Taken) {
    let pid = peer.pid;
    let listeners = handoff.listeners.clone();
    let metrics = handoff.metrics.clone();
    handoff.tasks.spawn(async move {
        let ack = Message::Ack {
            cookies: taken.cookies,
        };
        let written = tokio::time::timeout(super::ACK_WRITE_TIMEOUT, peer.send(&ack, &[])).await;
        if !matches!(written, Ok(Ok(()))) {
            metrics.handoff(HandoffDirection::ConnectionsReceived, HandoffOutcome::Error);
            tracing::warn!(
                peer.pid = pid,
                "handoff: cannot acknowledge connections; left to the predecessor"
            );
            return;
        }
        let n = taken.conns.len();
        let clients: Vec<String> = taken
            .conns
            .iter()
            .map(|c| c.client_addr.to_string())
            .collect();
        for conn in taken.conns {
            listeners.resume_connection(conn);
        }
        metrics.handoff(HandoffDirection::ConnectionsReceived, HandoffOutcome::Ok);
        // One line per batch (at most 32 connections), naming what we now own.
        tracing::info!(
            peer.pid = pid,
            offered = taken.offered,
            taken = n,
            clients = clients.join(","),
            "handoff: took over established connections"
        );
    });
}
