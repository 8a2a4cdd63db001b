//! `--client-address transparent`: the connection to a loopback backend carries the client's
//! own address as its source, so kube-apiserver logs and audits the real client instead of
//! 127.0.0.1 (it has no PROXY protocol).
//!
//! The backend connection's socket gets `IP_TRANSPARENT` (`CAP_NET_RAW` or `CAP_NET_ADMIN`) and
//! `IP_BIND_ADDRESS_NO_PORT`, and is bound to the client's IP with port 0: the IP is what the
//! audit log keeps, and the client's own port could collide (a client on this host holds it
//! already). The backend's answers to that address reach the proxy only through the node's
//! policy routing ([`crate::backends::routes`], installed by `transparent-routes`).
//!
//! Decided once per connection ([`source_for`], [`applies`]): clients on the node itself
//! (loopback, or the address they connected to) and backends that are not on loopback, or not
//! of the client's family, are connected as without the mode. Whether it works is verified per
//! loopback backend, at start and every [`VERIFY_EVERY`] ([`run`]): a connection from a
//! documentation address ([`test_source`]) to a listener of our own on the backend's IP must
//! complete. Until it has, and whenever it stops doing so (no capability, the routing missing,
//! a firewall rule dropping it), connections to that backend are made normally and counted
//! (`client_address_connections_total{result="fallback"}`), the reason is logged once and
//! shown in `/status`: a client is never refused for it. A transparent connect that times out
//! is retried at once without the mode. A backend in 127.0.0.0/24, which the routing leaves to
//! the host's own traffic, never verifies ([`verify`]); given as `--backend` it is refused at
//! start (`crate::config`): the mode could never keep an address there.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often each loopback backend's transparent connection is verified.
pub const VERIFY_EVERY: Duration = Duration::from_secs(5);
/// How long a verification connect may take: on loopback it completes in microseconds when
/// the answer is routed back, and never when it is not.
pub const VERIFY_TIMEOUT: Duration = Duration::from_secs(1);

/// The source a verification connects from: an address of the documentation ranges (RFC 5737,
/// RFC 3849), which no client has.
pub fn test_source(backend: IpAddr) -> IpAddr {
    match backend {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::new(203, 0, 113, 1)),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1)),
    }
}

/// The source address for a connection from `client` that arrived on local address `local`
/// (the listening address, or the accepted socket's when that is a wildcard): the client's IP,
/// unless the client is on this node (loopback, or the very address it connected to).
pub fn source_for(client: IpAddr, local: IpAddr) -> Option<IpAddr> {
    let client = client.to_canonical();
    if client.is_loopback() || client.is_unspecified() || client == local.to_canonical() {
        return None;
    }
    Some(client)
}

/// Whether a connection whose source is to be `source` is made transparently to `backend`: a
/// loopback backend of the same family.
pub fn applies(source: IpAddr, backend: SocketAddr) -> bool {
    backend.ip().is_loopback() && source.is_ipv4() == backend.is_ipv4()
}

const UNVERIFIED: u8 = 0;
const WORKS: u8 = 1;
const FAILS: u8 = 2;

/// One backend's verdict, read on the connect path without a lock.
#[derive(Default)]
pub struct BackendState {
    verdict: AtomicU8,
    /// Why it fails (for `/status`), set with the verdict.
    reason: Mutex<Option<String>>,
}

impl BackendState {
    /// Whether connections to this backend are made transparently now.
    #[inline]
    pub fn works(&self) -> bool {
        self.verdict.load(Ordering::Relaxed) == WORKS
    }

    /// Records a verification; returns whether the verdict changed.
    fn record(&self, result: &Result<(), VerifyError>) -> bool {
        let new = if result.is_ok() { WORKS } else { FAILS };
        *self.reason.lock().expect("reason lock") = result.as_ref().err().map(ToString::to_string);
        self.verdict.swap(new, Ordering::Relaxed) != new
    }

    /// A transparent connect failed in a way that says the mode does not work (it timed out,
    /// or the socket could not be set up): connect normally until the next verification.
    pub fn distrust(&self, reason: String) {
        if self.verdict.swap(UNVERIFIED, Ordering::Relaxed) == WORKS {
            tracing::warn!(error = %reason, "client address: a transparent connect failed; connecting normally until it verifies again");
        }
        *self.reason.lock().expect("reason lock") = Some(reason);
    }

    /// What `/status` shows: `works`, `unverified` or `fails: …`.
    pub fn describe(&self) -> String {
        let reason = self.reason.lock().expect("reason lock").clone();
        match (self.verdict.load(Ordering::Relaxed), reason) {
            (WORKS, _) => "works".into(),
            (FAILS, Some(r)) => format!("fails: {r}"),
            (_, Some(r)) => format!("unverified: {r}"),
            _ => "unverified".into(),
        }
    }
}

/// Verifies, every [`VERIFY_EVERY`] and whenever the backends change (`changes`), that a
/// transparent connection reaches each loopback backend's IP; logs each change of a backend's
/// verdict. `backends` lists the backends now, each address with the state that keeps its
/// verdict: the loop knows nothing else of backends.
pub async fn run(
    backends: impl Fn() -> Vec<(SocketAddr, Arc<BackendState>)>,
    mut changes: watch::Receiver<u64>,
    stop: CancellationToken,
) {
    tracing::info!(
        "client address: transparent (each loopback backend is verified before it is used)"
    );
    loop {
        for (addr, state) in backends() {
            if !addr.ip().is_loopback() {
                continue;
            }
            let result = verify(addr.ip()).await;
            if state.record(&result) {
                match &result {
                    Ok(()) => {
                        tracing::info!(backend = %addr, "client address: transparent: the backend sees each client's own address")
                    }
                    Err(reason) => {
                        tracing::warn!(backend = %addr, reason = %reason, "client address: connecting normally: the backend sees the proxy's loopback address")
                    }
                }
            }
        }
        changes.mark_unchanged();
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = changes.changed() => {}
            _ = tokio::time::sleep(VERIFY_EVERY) => {}
        }
    }
}

/// One verification: a transparent connect from [`test_source`] to a listener of our own on
/// `ip`, answered through the same routing a backend's answers take. `Err`: why not.
///
/// A backend in 127.0.0.0/24 fails at once: the routing sends its answers by the main table,
/// where whether they come back depends on the client's address (a test source without a
/// route there comes back, a client on the node's network never does), so no test source can
/// stand for every client.
pub async fn verify(ip: IpAddr) -> Result<(), VerifyError> {
    if in_host_range(ip) {
        return Err(VerifyError::HostRange);
    }
    let listener = tokio::net::TcpListener::bind((ip, 0))
        .await
        .map_err(|source| VerifyError::Listen { ip, source })?;
    let target = listener.local_addr().map_err(VerifyError::LocalAddr)?;
    let source = test_source(ip);
    match crate::base::net::connect_from(source, target, VERIFY_TIMEOUT).await {
        Ok(_stream) => {
            // Accepted already (the handshake is done); the peer is the source asked for.
            let accepted = tokio::time::timeout(VERIFY_TIMEOUT, listener.accept()).await;
            match accepted {
                Ok(Ok((_, peer))) if peer.ip() == source => Ok(()),
                Ok(Ok((_, peer))) => Err(VerifyError::Peer(peer)),
                _ => Err(VerifyError::NotAccepted),
            }
        }
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => Err(VerifyError::NotPermitted),
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
            // A netlink exchange: blocking, so off the runtime's thread.
            let lookup = tokio::task::spawn_blocking(move || {
                crate::backends::routes::delivered_locally(ip, source)
            })
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)));
            Err(match lookup {
                Ok(false) => VerifyError::NotRouted,
                Ok(true) => VerifyError::Dropped,
                Err(e) => VerifyError::NoAnswer(e),
            })
        }
        Err(e) => Err(VerifyError::Connect(e)),
    }
}

/// Why a transparent connection does not reach a backend's IP ([`verify`]).
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error("{HOST_RANGE}")]
    HostRange,
    #[error("cannot listen on {ip} to verify: {source}")]
    Listen {
        ip: IpAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    LocalAddr(std::io::Error),
    #[error("the connection arrived from {0}")]
    Peer(SocketAddr),
    #[error("the connection was not accepted")]
    NotAccepted,
    #[error("IP_TRANSPARENT not permitted: the proxy needs CAP_NET_RAW (or CAP_NET_ADMIN)")]
    NotPermitted,
    #[error("the answers are not routed back: the policy routing is missing (run `kube-apiserver-proxy transparent-routes`)")]
    NotRouted,
    #[error("no answer although the policy routing is in place: a firewall rule drops it (kubelet's and kube-proxy's `block incoming localnet connections`, docs/operations.md)")]
    Dropped,
    #[error("no answer (and the route could not be looked up: {0})")]
    NoAnswer(std::io::Error),
    #[error("transparent connect failed: {0}")]
    Connect(std::io::Error),
}

/// Why a backend in 127.0.0.0/24 is never connected transparently.
pub const HOST_RANGE: &str = "the backend is in 127.0.0.0/24, which the policy routing leaves to the host's own traffic: bind the backend outside it";

/// 127.0.0.0/24: the loopback addresses the policy routing leaves alone ([`crate::backends::routes`]).
pub fn in_host_range(ip: IpAddr) -> bool {
    matches!(ip, IpAddr::V4(v4) if v4.octets()[..3] == [127, 0, 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_on_the_node_keep_a_normal_connection() {
        let node: IpAddr = "192.0.2.10".parse().unwrap();
        let remote: IpAddr = "198.51.100.7".parse().unwrap();
        assert_eq!(source_for(remote, node), Some(remote));
        assert_eq!(source_for(node, node), None);
        assert_eq!(source_for("127.0.0.1".parse().unwrap(), node), None);
        assert_eq!(source_for("::1".parse().unwrap(), node), None);
        // A v4-mapped client is its v4 address.
        assert_eq!(
            source_for("::ffff:198.51.100.7".parse().unwrap(), node),
            Some(remote)
        );
        assert_eq!(
            source_for(
                "::ffff:192.0.2.10".parse().unwrap(),
                "::ffff:192.0.2.10".parse().unwrap()
            ),
            None
        );
    }

    #[test]
    fn only_loopback_backends_of_the_clients_family() {
        let v4: IpAddr = "198.51.100.7".parse().unwrap();
        let v6: IpAddr = "2001:db8::7".parse().unwrap();
        assert!(applies(v4, "127.1.2.3:6443".parse().unwrap()));
        assert!(!applies(v6, "127.1.2.3:6443".parse().unwrap()));
        assert!(applies(v6, "[::1]:6443".parse().unwrap()));
        assert!(!applies(v4, "[::1]:6443".parse().unwrap()));
        // A remote backend answers the client directly: never.
        assert!(!applies(v4, "192.0.2.20:6443".parse().unwrap()));
    }

    #[test]
    fn a_distrusted_backend_is_not_used_until_verified_again() {
        let state = BackendState::default();
        assert!(!state.works());
        assert!(state.record(&Ok(())));
        assert!(!state.record(&Ok(())));
        assert!(state.works());
        state.distrust("timed out".into());
        assert!(!state.works());
        assert_eq!(state.describe(), "unverified: timed out");
        assert!(state.record(&Err(VerifyError::NotRouted)));
        assert_eq!(
            state.describe(),
            format!("fails: {}", VerifyError::NotRouted)
        );
        assert!(state.describe().contains("the policy routing is missing"));
        assert!(state.record(&Ok(())));
        assert_eq!(state.describe(), "works");
    }
}
