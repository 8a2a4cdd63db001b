//! One proxied connection: choose a backend, connect (falling over to the next one on failure,
//! before the client has seen anything; with none reachable, holding the client and trying
//! again within `--connect-timeout`), then copy bytes both ways until both sides are done.
//!
//! An established connection ends only when one side closes it, the kernel finds it dead
//! (reset, keepalive, `TCP_USER_TIMEOUT`), or the drain deadline cuts it — never because its
//! backend stopped listening: kube-apiserver closes its listener first and then goes on
//! draining the requests and watches on the connections it has.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::addr::ClientAddr;
use crate::backend::{Backend, Backends};
use crate::copy::{self, Copied, Pending};
use crate::lograte::LogRate;
use crate::metrics::{FailReason, Metrics};
use crate::net;

/// Failures on client traffic are logged at most once a second each (counted in metrics always).
static NO_BACKEND_LOG: LogRate = LogRate::new(Duration::from_secs(1));
static CONNECT_FAILED_LOG: LogRate = LogRate::new(Duration::from_secs(1));

/// What every connection task shares.
pub struct ForwardContext {
    pub backends: Arc<Backends>,
    pub metrics: Metrics,
    pub connect_timeout: Duration,
    /// Cancelled at the drain deadline: connections close, each after a random delay within
    /// `close_window`, so clients do not all reconnect in one instant.
    pub cut: CancellationToken,
    pub close_window: Duration,
    /// Zero-copy or buffered forwarding.
    pub copy_mode: copy::Mode,
    /// Every carried connection, for the connection handoff of an in-place upgrade.
    pub transfers: Arc<crate::transfer::Registry>,
}

/// Carries one client connection to its end.
pub async fn serve(client: TcpStream, client_addr: ClientAddr, ctx: Arc<ForwardContext>) {
    let _active = ActiveConnection::new(&ctx.metrics);
    // The client socket inherited its options from the listener (net::tune_listener).
    let Some((backend, upstream)) = connect_any(&ctx).await else {
        ctx.metrics.connection_failed(FailReason::NoBackend);
        if let Some(suppressed) = NO_BACKEND_LOG.allow() {
            tracing::warn!(client.addr = %client_addr, suppressed, hold = ?ctx.connect_timeout, "no backend could be reached within the connect timeout: closing client");
        }
        return;
    };
    let _tracked = backend.track();
    carry(client, upstream, client_addr, Pending::default(), &ctx).await;
}

/// Carries on a connection handed over by the predecessor of an in-place upgrade: its pending
/// bytes are written first.
pub async fn resume(
    client: TcpStream,
    upstream: TcpStream,
    client_addr: ClientAddr,
    pending: Pending,
    ctx: Arc<ForwardContext>,
) {
    let _active = ActiveConnection::new(&ctx.metrics);
    let backend_addr = upstream.peer_addr().ok();
    let _tracked = ctx
        .backends
        .snapshot()
        .iter()
        .find(|b| Some(b.addr.0) == backend_addr)
        .map(|b| b.track());
    carry(client, upstream, client_addr, pending, &ctx).await;
}

/// Copies until the connection ends, the drain deadline cuts it, or it is handed over.
async fn carry(
    client: TcpStream,
    upstream: TcpStream,
    client_addr: ClientAddr,
    mut pending: Pending,
    ctx: &ForwardContext,
) {
    let mut registration = ctx.transfers.register();
    let cut = async {
        ctx.cut.cancelled().await;
        let window = ctx.close_window;
        if !window.is_zero() {
            let delay = window.mul_f64(rand::thread_rng().gen_range(0.0..1.0));
            tokio::time::sleep(delay).await;
        }
    };
    tokio::pin!(cut);
    let counters = (
        &ctx.metrics.bytes_client_to_backend,
        &ctx.metrics.bytes_backend_to_client,
    );
    loop {
        let pause = CancellationToken::new();
        let parked = {
            let copy = copy::bidirectional(
                &client,
                &upstream,
                ctx.copy_mode,
                counters,
                std::mem::take(&mut pending),
                &pause,
            );
            tokio::pin!(copy);
            tokio::select! {
                result = &mut copy => {
                    if let Err(e) = result {
                        tracing::debug!(client.addr = %client_addr, error = %e, "connection ended with error");
                    }
                    return;
                }
                _ = &mut cut => None,
                Some(park) = registration.parks.recv() => {
                    pause.cancel();
                    match copy.await {
                        Ok(Copied::Paused(p)) => Some((park, p)),
                        Ok(Copied::Done) => return,
                        Err(e) => {
                            tracing::debug!(client.addr = %client_addr, error = %e, "connection ended with error");
                            return;
                        }
                    }
                }
            }
        };
        let Some((park, paused)) = parked else {
            tracing::debug!(client.addr = %client_addr, "closing: drain deadline");
            drop(upstream);
            close_gracefully(client).await;
            return;
        };
        pending = paused;
        if crate::transfer::offer(park, &client, &upstream, client_addr.0, &pending).await {
            // The successor carries it on: close our descriptors only (never shutdown()).
            return;
        }
    }
}

/// How long a closed-by-us client may take to close its side.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// Ends a connection the proxy decided to close with a FIN, not a reset: closing a socket with
/// unread data sends RST, which clients report as an error. So: shut down our write side, read
/// and discard whatever the client still sends until it closes too (or a short linger passes),
/// then close.
async fn close_gracefully(client: TcpStream) {
    if socket2::SockRef::from(&client)
        .shutdown(std::net::Shutdown::Write)
        .is_err()
    {
        return;
    }
    let drain = async {
        let mut sink = [0u8; 1024];
        loop {
            client.readable().await?;
            match client.try_read(&mut sink) {
                Ok(0) => return Ok::<_, std::io::Error>(()),
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_LINGER, drain).await;
}

/// First pause before trying every backend again for a held client; doubles up to
/// [`HOLD_RETRY_MAX`].
const HOLD_RETRY_MIN: Duration = Duration::from_millis(50);
const HOLD_RETRY_MAX: Duration = Duration::from_millis(500);

/// Finds a backend for a new client: tries every backend in selection order (each failure
/// marks that backend suspect). When none could be reached, the client is held (it has seen
/// nothing yet, and holding is cheap) and every backend — including any added meanwhile, by
/// discovery — is tried again, at the latest when the backends change, until
/// `--connect-timeout` has passed since the first round started. `None`: give up.
async fn connect_any(ctx: &ForwardContext) -> Option<(Arc<Backend>, TcpStream)> {
    let hold_until = tokio::time::Instant::now() + ctx.connect_timeout;
    let mut changes = ctx.backends.subscribe();
    let mut pause = HOLD_RETRY_MIN;
    loop {
        changes.mark_unchanged();
        for backend in ctx.backends.candidates() {
            let started = Instant::now();
            match net::connect(backend.addr.0, ctx.connect_timeout).await {
                Ok(stream) => {
                    backend
                        .metrics
                        .connect_duration
                        .observe(started.elapsed().as_secs_f64());
                    if let Err(e) = net::tune(&stream) {
                        tracing::debug!(backend = %backend.addr, error = %e, "cannot tune backend socket");
                    }
                    return Some((backend, stream));
                }
                Err(e) if net::is_local_exhaustion(&e) => {
                    // Out of descriptors here: no backend is to blame, and none would do better.
                    tracing::debug!(backend = %backend.addr, error = %e, "cannot open a backend socket");
                    return None;
                }
                Err(e) => {
                    if let Some(suppressed) = CONNECT_FAILED_LOG.allow() {
                        tracing::warn!(backend = %backend.addr, error = %e, suppressed, "backend connect failed: trying the next");
                    }
                    if backend.suspect().is_some() {
                        ctx.backends.notify();
                    }
                }
            }
        }
        let now = tokio::time::Instant::now();
        if now >= hold_until {
            return None;
        }
        tokio::select! {
            _ = changes.changed() => {}
            _ = tokio::time::sleep(pause) => {}
            _ = tokio::time::sleep_until(hold_until) => {}
        }
        pause = (pause * 2).min(HOLD_RETRY_MAX);
    }
}

/// Keeps `connections_active` right on every exit path.
struct ActiveConnection<'a>(&'a Metrics);

impl<'a> ActiveConnection<'a> {
    fn new(metrics: &'a Metrics) -> Self {
        metrics.connections_active.inc();
        ActiveConnection(metrics)
    }
}

impl Drop for ActiveConnection<'_> {
    fn drop(&mut self) {
        self.0.connections_active.dec();
    }
}
