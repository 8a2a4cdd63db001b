//! Load generator primitives: connect (plain TCP, or TLS to the TLS echo backend), one
//! request/response exchange, a churn request (new connection per request), bulk transfer, the
//! measurement window every scenario shares, and the two loops of the steady load of `rollout`
//! and `chaos`: paced requests and a pinged long-lived stream, both until told to stop.
//! Every operation is bounded by a timeout and every failure is classified ([`FailureKind`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::task::{JoinError, JoinHandle};
use tokio::time::{Instant, MissedTickBehavior};

use crate::backend::{TlsClient, CLOSE_AFTER_REPLY};
use crate::options::{LoadArgs, Timing};
use crate::outcome::FailureKind;

/// The measured part of a run: load starts at `load_start`, samples count from `start` to
/// `end`, load stops at `end`.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub load_start: Instant,
    pub start: Instant,
    pub end: Instant,
}

impl Window {
    /// A window starting after `timing.warmup` from now and lasting `timing.duration`.
    pub fn from_now(timing: &Timing) -> Self {
        let load_start = Instant::now();
        let start = load_start + timing.warmup;
        Self {
            load_start,
            start,
            end: start + timing.duration,
        }
    }

    /// Whether an operation that ran from `began` to `ended` counts.
    pub fn contains(&self, began: Instant, ended: Instant) -> bool {
        began >= self.start && ended <= self.end
    }

    /// Whether the load should stop.
    pub fn is_over(&self) -> bool {
        Instant::now() >= self.end
    }

    /// Length of the measured part.
    pub fn seconds(&self) -> f64 {
        (self.end - self.start).as_secs_f64()
    }
}

/// Runs `op` with a timeout, mapping elapsed time to [`FailureKind::Timeout`] and I/O errors to
/// their kind.
pub async fn bounded<T>(
    timeout: Duration,
    op: impl std::future::Future<Output = std::io::Result<T>>,
) -> Result<T, FailureKind> {
    match tokio::time::timeout(timeout, op).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(FailureKind::of(&err)),
        Err(_) => Err(FailureKind::Timeout),
    }
}

/// The address clients connect from (`--client-source`), set once at start.
static CLIENT_SOURCE: std::sync::OnceLock<std::net::IpAddr> = std::sync::OnceLock::new();

/// Makes every client connect from `ip` (port chosen at connect).
pub fn set_client_source(ip: std::net::IpAddr) {
    let _ = CLIENT_SOURCE.set(ip);
}

/// Connects with `TCP_NODELAY` (from `--client-source` when given).
pub async fn connect(addr: SocketAddr, timeout: Duration) -> Result<TcpStream, FailureKind> {
    bounded(timeout, async {
        let stream = match CLIENT_SOURCE.get() {
            None => TcpStream::connect(addr).await?,
            Some(&ip) => {
                let socket = socket2::Socket::new(
                    socket2::Domain::for_address(addr),
                    socket2::Type::STREAM,
                    None,
                )?;
                socket.set_nonblocking(true)?;
                // The port is chosen at connect, as without a source: the clients then hold
                // no port of their address that a backend connection from it could want
                // (a client off the node holds none of the node's).
                nix::sys::socket::setsockopt(
                    &socket,
                    nix::sys::socket::sockopt::IpBindAddressNoPort,
                    &true,
                )?;
                socket.bind(&SocketAddr::new(ip, 0).into())?;
                let socket = tokio::net::TcpSocket::from_std_stream(socket.into());
                socket.connect(addr).await?
            }
        };
        stream.set_nodelay(true)?;
        Ok(stream)
    })
    .await
}

/// Makes the TLS handshake on a connected `stream`, as [`TlsClient::handshake`].
pub async fn handshake(
    tls: &TlsClient,
    stream: TcpStream,
    timeout: Duration,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, FailureKind> {
    bounded(timeout, tls.handshake(stream)).await
}

/// Writes `request` and reads an answer of the same length (the echo backend's reply), on a
/// plain or a TLS stream.
pub async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    request: &[u8],
    answer: &mut [u8],
    timeout: Duration,
) -> Result<(), FailureKind> {
    bounded(timeout, async {
        stream.write_all(request).await?;
        // A no-op for TCP; TLS may hold records back when the socket is full.
        stream.flush().await?;
        stream.read_exact(&mut answer[..request.len()]).await?;
        Ok(())
    })
    .await
}

/// One request on a new connection: connect (and with `tls`, a full TLS handshake), send a
/// one-request message of `size` bytes (2 to 255; see [`CLOSE_AFTER_REPLY`]), read the echo,
/// then wait for the backend's close so that the client is not the side left in TIME_WAIT.
/// Returns the latency from the start of connect to the last byte of the answer.
pub async fn churn_request(
    addr: SocketAddr,
    size: usize,
    timeout: Duration,
    tls: Option<&TlsClient>,
) -> Result<Duration, FailureKind> {
    let began = Instant::now();
    let deadline = began + timeout;
    let stream = connect(addr, timeout).await?;
    match tls {
        None => one_request(stream, size, began, deadline).await,
        Some(tls) => {
            let left = deadline.saturating_duration_since(Instant::now());
            let stream = handshake(tls, stream, left).await?;
            one_request(stream, size, began, deadline).await
        }
    }
}

/// The exchange of [`churn_request`] on a connected stream.
async fn one_request<S: AsyncRead + AsyncWrite + Unpin>(
    mut stream: S,
    size: usize,
    began: Instant,
    deadline: Instant,
) -> Result<Duration, FailureKind> {
    let size = size.clamp(2, 255);
    let mut request = [0x43u8; 255];
    request[0] = CLOSE_AFTER_REPLY;
    request[1] = size as u8;
    let mut answer = [0u8; 255];
    let left = deadline.saturating_duration_since(Instant::now());
    exchange(&mut stream, &request[..size], &mut answer, left).await?;
    let latency = began.elapsed();
    // The answer is complete; how the connection ends no longer matters to the request.
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = tokio::time::timeout(left, stream.read(&mut answer)).await;
    Ok(latency)
}

/// Bulk transfer on one connection until the window ends: writes `chunk` repeatedly while
/// reading the echo concurrently; bytes read inside the window are added to `received`.
pub async fn bulk(
    addr: SocketAddr,
    chunk: usize,
    window: Window,
    received: Arc<AtomicU64>,
) -> Result<(), FailureKind> {
    let stream = connect(addr, Duration::from_secs(5)).await?;
    let (mut reader, mut writer) = stream.into_split();
    let write = async move {
        let buf = vec![0x5au8; chunk];
        while !window.is_over() {
            writer.write_all(&buf).await?;
        }
        writer.shutdown().await
    };
    let read = async move {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = reader.read(&mut buf).await?;
            if n == 0 {
                return Ok(());
            }
            let now = Instant::now();
            if now >= window.start && now <= window.end {
                received.fetch_add(n as u64, Ordering::Relaxed);
            }
        }
    };
    let write = tokio::spawn(write);
    let limit = window.end.saturating_duration_since(Instant::now()) + Duration::from_secs(10);
    let read_result = bounded(limit, read).await;
    let write_result = write.await.map_err(|_| FailureKind::Other)?;
    read_result?;
    write_result.map_err(|err| FailureKind::of(&err))
}

/// Resolves once the stop flag is set (or its sender is gone).
pub async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|&s| s).await;
}

/// Runs `request` every `period` from `first` (a tick missed while a request ran is skipped)
/// until `stop` is set; returns the results in order.
pub async fn paced<T, F: Future<Output = T>>(
    first: Instant,
    period: Duration,
    mut stop: watch::Receiver<bool>,
    mut request: impl FnMut() -> F,
) -> Vec<T> {
    let mut results = Vec::new();
    let mut ticks = tokio::time::interval_at(first, period);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stopped(&mut stop) => return results,
            _ = ticks.tick() => {}
        }
        results.push(request().await);
    }
}

/// How a pinged stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// The stop flag was set.
    Stopped,
    /// Closed cleanly (EOF) while idle.
    Eof,
    /// Data or an error while idle, where nothing was expected.
    Idle(FailureKind),
    /// A ping failed: no complete echo within the timeout.
    Ping(FailureKind),
}

/// Sends an 8-byte ping on `stream` every `interval` and waits for its echo (within
/// `timeout`), until the stream ends or `stop` is set; counts answered pings in `pings`.
pub async fn ping_stream(
    stream: &mut TcpStream,
    interval: Duration,
    timeout: Duration,
    stop: &mut watch::Receiver<bool>,
    pings: &mut u64,
) -> StreamEnd {
    let ping = [0x46u8; 8];
    let mut pong = [0u8; 64];
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stopped(stop) => return StreamEnd::Stopped,
            read = stream.read(&mut pong) => {
                // Nothing is expected while idle: EOF is a close, anything else a failure.
                return match read {
                    Ok(0) => StreamEnd::Eof,
                    Ok(_) => StreamEnd::Idle(FailureKind::Other),
                    Err(err) => StreamEnd::Idle(FailureKind::of(&err)),
                };
            }
            _ = ticks.tick() => {
                let exchange = bounded(timeout, async {
                    stream.write_all(&ping).await?;
                    stream.read_exact(&mut pong[..ping.len()]).await?;
                    Ok(())
                });
                match exchange.await {
                    Ok(()) => *pings += 1,
                    Err(kind) => return StreamEnd::Ping(kind),
                }
            }
        }
    }
}

/// The steady load of `rollout` and `chaos` while it runs: paced churn clients and long-lived
/// streams, stopped together. `C` is what a churn client returns, `S` what a stream returns.
#[derive(Debug)]
pub struct Steady<C, S> {
    stop: watch::Sender<bool>,
    churn: Vec<JoinHandle<C>>,
    streams: Vec<JoinHandle<S>>,
}

impl<C: Send + 'static, S: Send + 'static> Steady<C, S> {
    /// Spawns `load.clients` churn clients (at least one) and `load.streams` streams. Each
    /// churn client is given its first tick and its period: together they send `load.rate`
    /// requests per second, the i-th starting i/clients of a period after `first`. Each client
    /// is given the stop flag.
    pub fn start<FC, FS>(
        load: &LoadArgs,
        first: Instant,
        churn: impl Fn(Instant, Duration, watch::Receiver<bool>) -> FC,
        stream: impl Fn(watch::Receiver<bool>) -> FS,
    ) -> Self
    where
        FC: Future<Output = C> + Send + 'static,
        FS: Future<Output = S> + Send + 'static,
    {
        let (stop, stop_rx) = watch::channel(false);
        let clients = load.clients.max(1);
        let period = Duration::from_secs_f64(clients as f64 / f64::from(load.rate.max(1)));
        let churn = (0..clients)
            .map(|i| {
                let offset = period.mul_f64(i as f64 / clients as f64);
                tokio::spawn(churn(first + offset, period, stop_rx.clone()))
            })
            .collect();
        let streams = (0..load.streams)
            .map(|_| tokio::spawn(stream(stop_rx.clone())))
            .collect();
        Self {
            stop,
            churn,
            streams,
        }
    }

    /// Stops the clients (each finishes its operation in progress) and returns what each
    /// churn client and each stream returned, or how its task failed.
    pub async fn stop(self) -> (Vec<Result<C, JoinError>>, Vec<Result<S, JoinError>>) {
        let _ = self.stop.send(true);
        let mut churn = Vec::new();
        for task in self.churn {
            churn.push(task.await);
        }
        let mut streams = Vec::new();
        for task in self.streams {
            streams.push(task.await);
        }
        (churn, streams)
    }
}
