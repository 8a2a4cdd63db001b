//! One proxied connection: choose a backend, connect (falling over to the next one on failure,
//! before the client has seen anything; with none reachable, holding the client and trying
//! again within `--connect-timeout`), then copy bytes both ways until both sides are done.
//!
//! An established connection ends only when one side closes it, the kernel finds it dead
//! (reset, keepalive, `TCP_USER_TIMEOUT`), or the drain deadline cuts it — never because its
//! backend stopped listening: kube-apiserver closes its listener first and then goes on
//! draining the requests and watches on the connections it has.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use rand::Rng;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use crate::backends::backend::{Backend, Backends};
use crate::backends::pace::{Turn, TURN_WAIT};
use crate::backends::transparent;
use crate::base::addr::ClientAddr;
use crate::base::lograte::LogRate;
use crate::base::net;
use crate::data::control::{Control, Registry, Signal};
use crate::data::copy::{self, Copied, Pending};
use crate::data::metrics::{DataMetrics, FailReason};
use crate::data::transfer::{self, Park};

/// Failures on client traffic are logged at most once a second each (counted in metrics always).
static NO_BACKEND_LOG: LogRate = LogRate::new(Duration::from_secs(1));
static CONNECT_FAILED_LOG: LogRate = LogRate::new(Duration::from_secs(1));

/// What every connection task shares. Read-only on the data path: a connection writes only
/// to its own [`Control`] and to per-thread counters.
pub struct ForwardContext {
    pub backends: Arc<Backends>,
    pub metrics: DataMetrics,
    pub connect_timeout: Duration,
    /// Cancelled at the drain deadline: every connection is cut through its own control
    /// ([`Registry::cut_all`], see [`cut_on_cancel`]) and closes after a random delay within
    /// `close_window`, so clients do not all reconnect in one instant.
    pub cut: CancellationToken,
    pub close_window: Duration,
    /// Zero-copy or buffered forwarding.
    pub copy_mode: copy::Mode,
    /// Every carried connection: cut at the drain deadline, parked at the connection handoff
    /// of an in-place upgrade.
    pub carried: Arc<Registry<Park>>,
    /// Set once a draining instance's listening sockets were all adopted by a peer: a client
    /// this instance accepted earlier and can no longer connect to any backend is then carried
    /// to the address it connected to, which only that successor serves now.
    pub successor_serves: std::sync::atomic::AtomicBool,
    /// `--client-address transparent`: connections to loopback backends carry the client's
    /// address (transparent.rs).
    pub transparent: bool,
}

#[cfg(test)]
impl ForwardContext {
    /// A context for the crate's tests: TCP-checked backends (stopped with `stop`) and the data
    /// path's metrics on `registry`, a 1 s connect timeout, `--copy auto`, a cut of its own.
    pub(crate) fn for_tests(
        registry: &prometheus::Registry,
        stop: &CancellationToken,
    ) -> ForwardContext {
        ForwardContext {
            backends: Backends::new(
                crate::backends::check::HealthConfig::tcp_for_tests(),
                crate::backends::metrics::BackendFamilies::register(registry),
                stop.child_token(),
            ),
            metrics: DataMetrics::register(registry),
            connect_timeout: Duration::from_secs(1),
            cut: CancellationToken::new(),
            close_window: Duration::ZERO,
            copy_mode: copy::Mode::Auto,
            carried: Arc::default(),
            successor_serves: Default::default(),
            transparent: false,
        }
    }
}

/// Cuts every carried connection once `ctx.cut` is cancelled (run as a task of the instance).
pub async fn cut_on_cancel(ctx: Arc<ForwardContext>) {
    ctx.cut.cancelled().await;
    ctx.carried.cut_all();
}

/// Carries one client connection to its end. `source`: the client's address, for a connection
/// to be made transparently (decided by the accept loop, [`transparent::source_for`]).
///
/// Every connection's task holds this future for its whole life, so it is kept small
/// (`tests::a_connection_future_stays_small`): an `async move` block rather than an `async
/// fn` (which keeps its arguments twice), and the connect phase boxed (it is over once
/// connected, and would otherwise size every connection's state by its own).
#[allow(clippy::manual_async_fn)] // an `async fn` would keep its arguments twice (copy::one_way)
pub fn serve(
    client: TcpStream,
    client_addr: ClientAddr,
    source: Option<IpAddr>,
    ctx: Arc<ForwardContext>,
) -> impl Future<Output = ()> {
    async move {
        let _active = ActiveConnection::new(&ctx.metrics);
        // The client socket inherited its options from the listener (net::tune_listener).
        let Some((backend, upstream, turn)) = Box::pin(connect_any(&ctx, &client, source)).await
        else {
            ctx.metrics.connection_failed(FailReason::NoBackend);
            if let Some(suppressed) = NO_BACKEND_LOG.allow() {
                tracing::warn!(client.addr = %client_addr, suppressed, hold = ?ctx.connect_timeout, "no backend could be reached within the connect timeout: closing client");
            }
            // With a FIN: the client has likely sent its first bytes (a TLS ClientHello), and
            // dropping the socket with them unread would send it a reset.
            Box::pin(close_gracefully(client)).await;
            return;
        };
        // Borrowed in a block of its own: a local borrowed in the task's scope would keep its
        // storage in the connection's state for good, after it moved into `carry`.
        let upstream = {
            let upstream = upstream;
            if let Some(b) = backend.as_deref() {
                trace_seen_as(client_addr, b, &upstream);
            }
            upstream
        };
        let _tracked = backend.map(|b| b.track());
        #[cfg(feature = "planted-faults")]
        if crate::fault::hangs_this_connection() {
            Box::pin(carry_then_hang(client, upstream, client_addr, turn, &ctx)).await;
            return;
        }
        carry(
            client,
            upstream,
            client_addr,
            Pending::default(),
            turn,
            &ctx,
        )
        .await;
    }
}

/// `--planted-fault=hang-after-10s`: carries a connection as usual for a while, then holds it
/// open without relaying anything (fault.rs).
#[cfg(feature = "planted-faults")]
async fn carry_then_hang(
    client: TcpStream,
    upstream: TcpStream,
    client_addr: ClientAddr,
    turn: Option<Turn>,
    ctx: &ForwardContext,
) {
    let held = crate::fault::Held::new(&client, &upstream);
    let carried = carry(client, upstream, client_addr, Pending::default(), turn, ctx);
    crate::fault::hang(held, carried, ctx.cut.clone()).await;
}

/// Which address the backend sees for this client's connection: a debug line under the log
/// target `client_address` (`--log-level=info,client_address=debug`), how an audit entry's
/// `127.0.0.1:PORT` is traced back to its client without the transparent mode. Costs one
/// check of the log filter unless it is enabled.
fn trace_seen_as(client_addr: ClientAddr, backend: &Backend, upstream: &TcpStream) {
    if tracing::enabled!(target: "client_address", tracing::Level::DEBUG) {
        if let Ok(seen_as) = upstream.local_addr() {
            tracing::debug!(target: "client_address", seen_as = %seen_as, client.addr = %client_addr, backend = %backend.addr, "connected");
        }
    }
}

/// Carries on a connection handed over by the predecessor of an in-place upgrade: its pending
/// bytes are written first.
#[allow(clippy::manual_async_fn)] // an `async fn` would keep its arguments twice (copy::one_way)
pub fn resume(
    client: TcpStream,
    upstream: TcpStream,
    client_addr: ClientAddr,
    pending: Pending,
    ctx: Arc<ForwardContext>,
) -> impl Future<Output = ()> {
    async move {
        let _active = ActiveConnection::new(&ctx.metrics);
        let backend_addr = upstream.peer_addr().ok();
        let _tracked = ctx
            .backends
            .snapshot()
            .iter()
            .find(|b| Some(b.addr.0) == backend_addr)
            .map(|b| b.clone().track());
        carry(client, upstream, client_addr, pending, None, &ctx).await;
    }
}

/// Copies until the connection ends, the drain deadline cuts it, or it is handed over. A held
/// client's `turn` (pace.rs) is given back once the backend answers.
#[allow(clippy::manual_async_fn)] // an `async fn` would keep its arguments twice (copy::one_way)
fn carry(
    client: TcpStream,
    upstream: TcpStream,
    client_addr: ClientAddr,
    mut pending: Pending,
    mut turn: Option<Turn>,
    ctx: &ForwardContext,
) -> impl Future<Output = ()> + '_ {
    async move {
        let registration = ctx.carried.register();
        let control = registration.control();
        let counters = (
            &*ctx.metrics.bytes_client_to_backend,
            &*ctx.metrics.bytes_backend_to_client,
        );
        // Created at the drain deadline only: the moment within the close window to close at.
        let mut closing = None;
        loop {
            let copied = {
                let copy = copy::bidirectional(
                    &client,
                    &upstream,
                    ctx.copy_mode,
                    counters,
                    std::mem::take(&mut pending),
                    turn.take(),
                    control,
                );
                tokio::pin!(copy);
                std::future::poll_fn(|cx| loop {
                    if let Poll::Ready(result) = copy.as_mut().poll(cx) {
                        return Poll::Ready(Some(result));
                    }
                    // The one registration of this wake-up, for both signals: the copy only reads
                    // the park flag, so if it was raised meanwhile the copy is polled again.
                    if control.register(cx, Signal::PARK) {
                        continue;
                    }
                    return closing_time(cx, control, &mut closing, ctx.close_window)
                        .map(|()| None);
                })
                .await
            };
            match copied {
                Some(Ok(Copied::Done)) => return,
                Some(Err(e)) => {
                    tracing::debug!(client.addr = %client_addr, error = %e, "connection ended with error");
                    // The backend's side failed (or the client's): whatever the backend sent was
                    // delivered (copy::bidirectional); end the client's side with a FIN rather than
                    // the reset a close with unread bytes would send.
                    drop(upstream);
                    Box::pin(close_gracefully(client)).await;
                    return;
                }
                Some(Ok(Copied::Paused(paused))) => {
                    pending = paused;
                    if let Some(park) = control.take_park() {
                        if Box::pin(transfer::offer(
                            park,
                            &client,
                            &upstream,
                            client_addr.0,
                            &pending,
                        ))
                        .await
                        {
                            // The successor carries it on: close our descriptors only (never
                            // shutdown()).
                            return;
                        }
                    }
                    control.lower(Signal::PARK);
                }
                None => {
                    tracing::debug!(client.addr = %client_addr, "closing: drain deadline");
                    drop(upstream);
                    // Boxed: the close state is allocated only for the connections that close so.
                    Box::pin(close_gracefully(client)).await;
                    return;
                }
            }
        }
    }
}

/// Ready when a cut connection is to close: at a random point of the close window after the
/// cut (the timer is made only once the cut came; kept in `closing` across parks). The waker is
/// registered with `control` already.
fn closing_time(
    cx: &mut Context<'_>,
    control: &Control<Park>,
    closing: &mut Option<Pin<Box<tokio::time::Sleep>>>,
    window: Duration,
) -> Poll<()> {
    if closing.is_none() {
        if !control.is_raised(Signal::CUT) {
            return Poll::Pending;
        }
        if window.is_zero() {
            return Poll::Ready(());
        }
        let delay = window.mul_f64(rand::thread_rng().gen_range(0.0..1.0));
        *closing = Some(Box::pin(tokio::time::sleep(delay)));
    }
    match closing {
        Some(sleep) => sleep.as_mut().poll(cx),
        None => Poll::Pending,
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
        loop {
            client.readable().await?;
            if copy::discard(&client)? {
                return Ok::<_, std::io::Error>(());
            }
        }
    };
    let _ = tokio::time::timeout(CLOSE_LINGER, drain).await;
}

/// First pause before trying every backend again for a held client; doubles up to
/// [`HOLD_RETRY_MAX`], each pause drawn from half to one and a half of it (clients held at the
/// same instant do not all try again in the same instant).
const HOLD_RETRY_MIN: Duration = Duration::from_millis(50);
const HOLD_RETRY_MAX: Duration = Duration::from_millis(500);

/// What one connect attempt came to.
enum Attempt {
    Connected(TcpStream),
    /// This backend failed (now suspect): try the next.
    Failed,
    /// Out of descriptors here: no backend is to blame, and none would do better.
    Exhausted,
}

/// How one connect is made.
enum Via {
    Normal,
    /// With the client's address as its source.
    Transparent(IpAddr),
    /// Normally, although the client's address was wanted: the backend has not verified.
    Fallback,
}

/// Connects to `backend` for a client (with `source` as its address when it applies and the
/// backend verified, transparent.rs); a failure marks it suspect.
async fn attempt(ctx: &ForwardContext, backend: &Backend, source: Option<IpAddr>) -> Attempt {
    let via = match source {
        Some(src) if transparent::applies(src, backend.addr.0) => {
            if backend.transparent.works() {
                Via::Transparent(src)
            } else {
                Via::Fallback
            }
        }
        _ => Via::Normal,
    };
    let started = Instant::now();
    let connected = match via {
        Via::Normal => net::connect(backend.addr.0, ctx.connect_timeout).await,
        Via::Fallback => {
            let r = net::connect(backend.addr.0, ctx.connect_timeout).await;
            if r.is_ok() {
                ctx.metrics.client_address_fallback.inc();
            }
            r
        }
        Via::Transparent(src) => {
            // The socket is made before the await: the connection's future holds no more for
            // the mode than a plain connect's.
            let connected = match net::transparent_socket(src, backend.addr.0) {
                Ok(socket) => {
                    net::connect_socket(socket, backend.addr.0, ctx.connect_timeout).await
                }
                Err(e) => Err(e),
            };
            match connected {
                Ok(stream) => {
                    ctx.metrics.client_address_transparent.inc();
                    Ok(stream)
                }
                // No answer, or the socket could not be set up: the mode stopped working here
                // (routing or capability gone, a firewall rule), not the backend. Again without.
                Err(e) if transparent_failure(&e) => {
                    backend
                        .transparent
                        .distrust(format!("connect from {src}: {e}"));
                    let r = net::connect(backend.addr.0, ctx.connect_timeout).await;
                    if r.is_ok() {
                        ctx.metrics.client_address_fallback.inc();
                    }
                    r
                }
                Err(e) => Err(e),
            }
        }
    };
    match connected {
        Ok(stream) => {
            backend
                .metrics
                .connect_duration
                .observe(started.elapsed().as_secs_f64());
            if let Err(e) = net::tune_backend(&stream, backend.addr.0) {
                tracing::debug!(backend = %backend.addr, error = %e, "cannot tune backend socket");
            }
            Attempt::Connected(stream)
        }
        Err(e) if net::is_local_exhaustion(&e) => {
            tracing::debug!(backend = %backend.addr, error = %e, "cannot open a backend socket");
            Attempt::Exhausted
        }
        Err(e) => {
            if let Some(suppressed) = CONNECT_FAILED_LOG.allow() {
                tracing::warn!(backend = %backend.addr, error = %e, suppressed, "backend connect failed: trying the next");
            }
            if backend.suspect().is_some() {
                ctx.backends.notify();
            }
            Attempt::Failed
        }
    }
}

/// Whether a transparent connect's error is the mode's rather than the backend's.
fn transparent_failure(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::TimedOut
        || matches!(
            e.raw_os_error(),
            Some(
                libc::EPERM | libc::EACCES | libc::EADDRNOTAVAIL | libc::EADDRINUSE | libc::EINVAL
            )
        )
}

/// Finds a backend for a new client: tries every backend in selection order (each failure
/// marks that backend suspect). When none could be reached, the client is held (it has seen
/// nothing yet, and holding is cheap) and every backend — including any added meanwhile, by
/// discovery — is tried again, at the latest when the backends change, until
/// `--connect-timeout` has passed since the first round started. `None`: give up.
///
/// The first choice is found without building the ordered list (the common case: it
/// answers); the list is built only once it failed. A held client connects in turn (pace.rs):
/// the turn comes back with the connection, and is given back when the backend answers.
///
/// Once this instance is draining and a peer has adopted its listening sockets
/// ([`ForwardContext::successor_serves`]), a client no backend takes is carried to the address
/// it connected to (no backend then: `None` in the first place of the answer): the successor
/// accepts there and has backends of its own. Without it such a client, accepted in the
/// moments between the own apiserver closing its listener and the handoff, could only be
/// closed.
async fn connect_any(
    ctx: &ForwardContext,
    client: &TcpStream,
    source: Option<IpAddr>,
) -> Option<(Option<Arc<Backend>>, TcpStream, Option<Turn>)> {
    let hold_until = tokio::time::Instant::now() + ctx.connect_timeout;
    // Subscribed only once a round failed (a client that connects at once never needs it).
    let mut changes = None;
    let mut pause = HOLD_RETRY_MIN;
    let mut held = false;
    loop {
        let version = ctx.backends.version();
        let first = ctx.backends.first_choice();
        if let Some(backend) = &first {
            let turn = take_turn(held, backend).await;
            match attempt(ctx, backend, source).await {
                Attempt::Connected(stream) => return first.map(|b| (Some(b), stream, turn)),
                Attempt::Exhausted => return None,
                Attempt::Failed => {}
            }
        }
        let tried = first.map(|b| b.addr);
        for backend in ctx.backends.candidates() {
            if Some(backend.addr) == tried {
                continue;
            }
            let turn = take_turn(held, &backend).await;
            match attempt(ctx, &backend, source).await {
                Attempt::Connected(stream) => return Some((Some(backend), stream, turn)),
                Attempt::Exhausted => return None,
                Attempt::Failed => {}
            }
        }
        if ctx
            .successor_serves
            .load(std::sync::atomic::Ordering::Acquire)
        {
            if let Some(stream) = via_successor(ctx, client).await {
                return Some((None, stream, None));
            }
        }
        held = true;
        let now = tokio::time::Instant::now();
        if now >= hold_until {
            return None;
        }
        let changes = changes.get_or_insert_with(|| ctx.backends.subscribe());
        changes.mark_unchanged();
        // A change during the round (before the subscription) counts as one after it.
        let changed_meanwhile = ctx.backends.version() != version;
        if !changed_meanwhile {
            let jittered = pause.mul_f64(rand::thread_rng().gen_range(0.5..1.5));
            tokio::select! {
                _ = changes.changed() => {}
                _ = tokio::time::sleep(jittered) => {}
                _ = tokio::time::sleep_until(hold_until) => {}
            }
        }
        pause = (pause * 2).min(HOLD_RETRY_MAX);
    }
}

static VIA_SUCCESSOR_LOG: LogRate = LogRate::new(Duration::from_secs(1));

/// Connects to the address `client` connected to (the listening address a peer adopted).
async fn via_successor(ctx: &ForwardContext, client: &TcpStream) -> Option<TcpStream> {
    let addr = client.local_addr().ok()?;
    match net::connect(addr, ctx.connect_timeout).await {
        Ok(stream) => {
            ctx.metrics.connections_via_successor.inc();
            if let Some(suppressed) = VIA_SUCCESSOR_LOG.allow() {
                tracing::info!(listen.addr = %addr, suppressed, "no backend left: client carried to the successor that adopted the listening socket");
            }
            Some(stream)
        }
        Err(e) => {
            tracing::debug!(listen.addr = %addr, error = %e, "cannot reach the successor");
            None
        }
    }
}

/// A held client's turn to connect to `backend` (none for a client not held).
async fn take_turn(held: bool, backend: &Backend) -> Option<Turn> {
    if !held {
        return None;
    }
    backend.pace.turn(TURN_WAIT).await
}

/// Keeps `connections_active` right on every exit path.
struct ActiveConnection<'a>(&'a DataMetrics);

impl<'a> ActiveConnection<'a> {
    fn new(metrics: &'a DataMetrics) -> Self {
        metrics.connections_active.inc();
        ActiveConnection(metrics)
    }
}

impl Drop for ActiveConnection<'_> {
    fn drop(&mut self) {
        self.0.connections_active.dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What each connection task holds for its whole life: the future of `serve`. It was 2,072
    /// bytes (2,016 in a release build); the task around it (tokio's header and trailer, aligned
    /// to 128 bytes) took 2,176, and an idle connection 3.4 KiB of the proxy's RSS. Now 920
    /// (896 in a release build, a task of 1,024 bytes; 2.4 KiB per idle connection,
    /// docs/benchmarks.md): no `async fn` that keeps its arguments twice on the connection's
    /// path, the two directions one plain future, the connect phase and the rare waits boxed,
    /// no borrowed local of the task's scope left behind after a move.
    #[tokio::test]
    async fn a_connection_future_stays_small() {
        let ctx = crate::data::transfer::test_context(copy::Mode::Auto);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, peer) = listener.accept().await.unwrap();
        let future = serve(accepted, ClientAddr(peer), Some(peer.ip()), ctx);
        let size = std::mem::size_of_val(&future);
        eprintln!("serve future: {size} bytes");
        assert!(size <= 928, "serve future is {size} bytes");
    }

    /// Clients held while their backend was down are released at the pace it answers: when
    /// it comes back, no more than `pace::WINDOW` of them are ever opening a connection
    /// (connected, not yet answered) at once, and every one is served.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_clients_are_released_at_the_pace_the_backend_answers() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};

        const CLIENTS: usize = 2 * crate::backends::pace::WINDOW + 32;
        let mut ctx =
            Arc::into_inner(crate::data::transfer::test_context(copy::Mode::Auto)).unwrap();
        ctx.connect_timeout = Duration::from_secs(30);
        let ctx = Arc::new(ctx);
        // The backend's address is bound but not listening: connects are refused until it
        // listens.
        let socket =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        socket
            .bind(
                &"127.0.0.1:0"
                    .parse::<std::net::SocketAddr>()
                    .unwrap()
                    .into(),
            )
            .unwrap();
        let backend_addr = socket.local_addr().unwrap().as_socket().unwrap();
        ctx.backends.add(
            crate::base::addr::BackendAddr(backend_addr),
            crate::backends::backend::Tier::Static,
        );
        let backend = ctx.backends.snapshot()[0].clone();

        let front = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let front_addr = front.local_addr().unwrap();
        let serving = ctx.clone();
        tokio::spawn(async move {
            loop {
                let (stream, peer) = front.accept().await.unwrap();
                tokio::spawn(serve(stream, ClientAddr(peer), None, serving.clone()));
            }
        });
        let mut clients = tokio::task::JoinSet::new();
        for i in 0..CLIENTS {
            clients.spawn(async move {
                let mut s = TcpStream::connect(front_addr).await.unwrap();
                let ping = (i as u64).to_be_bytes();
                s.write_all(&ping).await.unwrap();
                let mut back = [0u8; 8];
                s.read_exact(&mut back).await.unwrap();
                assert_eq!(back, ping);
                s
            });
        }
        // Every client is held: each has seen the backend refuse.
        let deadline = Instant::now() + Duration::from_secs(20);
        while backend.metrics.connect_failures.get() < CLIENTS as u64 {
            assert!(Instant::now() < deadline, "clients not held");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }

        // The backend comes up: it takes every connection at once and answers each after a
        // short service time, counting the connections it has not answered yet.
        socket.listen(1024).unwrap();
        socket.set_nonblocking(true).unwrap();
        let listener = tokio::net::TcpListener::from_std(socket.into()).unwrap();
        // As its health check passing would: every held client wakes up at once.
        ctx.backends.notify();
        let opening = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let counts = opening.clone();
        tokio::spawn(async move {
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let counts = counts.clone();
                let now = counts.0.fetch_add(1, Ordering::SeqCst) + 1;
                counts.1.fetch_max(now, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut ping = [0u8; 8];
                    let read = s.read_exact(&mut ping).await;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    counts.0.fetch_sub(1, Ordering::SeqCst);
                    if read.is_ok() {
                        let _ = s.write_all(&ping).await;
                        let _ = s.read(&mut ping).await;
                    }
                });
            }
        });
        let served = tokio::time::timeout(Duration::from_secs(20), async {
            let mut kept = Vec::new();
            while let Some(client) = clients.join_next().await {
                kept.push(client.unwrap());
            }
            kept.len()
        })
        .await
        .expect("every held client served within the deadline");
        assert_eq!(served, CLIENTS);
        let most = opening.1.load(Ordering::SeqCst);
        eprintln!("at most {most} connections opening at once");
        assert!(
            most <= crate::backends::pace::WINDOW,
            "{most} connections opening at once, over the window of {}",
            crate::backends::pace::WINDOW
        );
        assert_eq!(backend.pace.free(), crate::backends::pace::WINDOW);
    }
}
