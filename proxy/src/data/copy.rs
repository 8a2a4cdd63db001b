//! Moving bytes both ways between client and backend, half-close aware, with no idle timeout.
//!
//! Two ways to move a burst of data (everything readable at one wake-up):
//!
//! - **buffered**: `read` into a per-thread scratch buffer and `write` straight on. The buffer
//!   is never held across a wait: only when the destination cannot take everything at once is
//!   the rest copied into a buffer owned by the connection until it is written.
//! - **splice**: `splice(2)` from one socket into a pipe and from the pipe into the other socket;
//!   the bytes never enter user space. Pipes come from a small pool per thread and are held
//!   only while data is in flight. If no pipe can be had (out of descriptors), the burst goes buffered.
//!
//! [`Mode::Auto`] (the default) picks per direction: buffered while bursts are small (API
//! requests, watch events: fewer system calls, no pipe), splice once a read fills the scratch
//! buffer (lists, logs, bulk: no copy through user space), back to buffered when bursts shrink.
//! Either way an idle connection holds no buffer and no pipe. When one side reaches EOF the
//! other side's write half is shut down (half-close propagates) and the other direction goes on.
//!
//! A copy can be **paused** (connection handoff at an in-place upgrade): each direction stops
//! at once, also in the middle of a burst, and returns the bytes it had read but not yet written
//! (for splice: what is in the pipe, read out of it). Nothing more is read from either socket.
//! A copy started with such pending bytes writes them first, then goes on as usual. A direction
//! that had reached EOF reads EOF again when resumed (and shuts down the write half again,
//! which is harmless), so no half-close state needs to travel.

use std::cell::RefCell;
use std::future::Future;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use nix::fcntl::{splice, OFlag, SpliceFFlags};
use nix::sys::socket::{recv, MsgFlags};
use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::backends::pace::Turn;
use crate::base::shard::{Counter, Gauge};
use crate::data::control::{Control, Signal};

/// Size of the per-thread scratch buffer; a read that fills it marks the direction as bulk.
const SCRATCH_LEN: usize = 64 * 1024;
/// Bytes moved per `splice` call at most (the default pipe capacity).
const SPLICE_CHUNK: usize = 64 * 1024;
/// A splice burst smaller than this sends an `Auto` direction back to buffered copying.
const SMALL_BURST: usize = 16 * 1024;
/// Idle pipes kept for reuse per thread; more are closed when returned.
const POOL_MAX: usize = 64;

/// How to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Buffered for small bursts, splice for bulk (default).
    Auto,
    /// Always splice (buffered only when no pipe can be had).
    Splice,
    /// Always buffered.
    Buffered,
}

/// A pipe used to splice one burst of data.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

/// One thread's idle pipes (a pipe taken on one thread may come back on another).
struct Pool(Vec<Pipe>);

impl Drop for Pool {
    fn drop(&mut self) {
        POOLED.add(-(self.0.len() as i64));
    }
}

thread_local! {
    static POOL: RefCell<Pool> = const { RefCell::new(Pool(Vec::new())) };
}

/// Idle pipes in all threads' pools.
static POOLED: Gauge = Gauge::new();

impl Pipe {
    fn take() -> io::Result<Pipe> {
        if let Ok(Some(p)) = POOL.try_with(|pool| pool.borrow_mut().0.pop()) {
            POOLED.add(-1);
            return Ok(p);
        }
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        Ok(Pipe { read, write })
    }

    /// Returns an empty pipe to this thread's pool (a pipe with data left in it is dropped
    /// instead).
    fn give_back(self) {
        let _ = POOL.try_with(|pool| {
            let mut pool = pool.borrow_mut();
            if pool.0.len() < POOL_MAX {
                pool.0.push(self);
                POOLED.add(1);
            }
        });
    }
}

/// Idle pipes in the pools now (each holds two descriptors).
pub fn pooled_pipes() -> usize {
    POOLED.get().max(0) as usize
}

thread_local! {
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0; SCRATCH_LEN]);
}

/// Bytes read from one side but not yet written to the other, per direction.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pending {
    /// Read from the client, for the backend.
    pub up: Vec<u8>,
    /// Read from the backend, for the client.
    pub down: Vec<u8>,
}

/// How a copy in both directions ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Copied {
    /// Both directions reached EOF.
    Done,
    /// Parked: nothing more was read; these bytes are still to be written.
    Paused(Pending),
}

/// Copies both ways — `pending` bytes first — until both directions reached EOF, either
/// failed, or the connection's [`Signal::PARK`] is raised. Bytes are added to the counters as
/// they are written. Whenever it returns pending, the caller registers the task's waker with
/// `pause` ([`Control::register`]) and polls again at once if the park flag is then raised.
///
/// Not `try_join!`: when one direction fails, the other is not dropped at once. A backend that
/// closed its connection (kube-apiserver after its GOAWAY, once in-flight requests are
/// answered) makes our next write to it fail while its last answers and its FIN are still on
/// the way to the client: the other direction delivers them (it ends by itself within moments,
/// at the backend's EOF or error), for at most [`FAILED_GRACE`]. The other way round there is
/// nothing to wait for: when reading from the backend failed because it reset the connection
/// (its socket is closed: no peer address), nothing the client sends can reach it, and the
/// client's side ends at once rather than after the grace (a client accepted in the instant its
/// backend crashed would otherwise wait a second for a close).
///
/// A direction that reaches EOF while the other goes on shuts down the write half of its
/// destination, so the half-close reaches the other peer. When the other direction has ended
/// already, the caller's close of both sockets sends that FIN (closing a socket sends a FIN,
/// not a reset, when everything it received was read: here it was, up to its EOF), which saves
/// a system call per connection.
///
/// Every connection holds this future for its whole life: a plain struct around the two
/// directions, with no `async` state of its own (see `one_way`).
pub fn bidirectional<'a, P>(
    client: &'a TcpStream,
    backend: &'a TcpStream,
    mode: Mode,
    counters: (&'a Counter, &'a Counter),
    pending: Pending,
    turn: Option<Turn>,
    pause: &'a Control<P>,
) -> impl Future<Output = io::Result<Copied>> + 'a
where
    P: 'a,
{
    Both {
        up: one_way(client, backend, mode, counters.0, pending.up, None, pause),
        down: one_way(backend, client, mode, counters.1, pending.down, turn, pause),
        client,
        backend,
        up_ended: None,
        down_ended: None,
        grace: None,
    }
}

/// How one direction ended: `None` at EOF, `Some` with the bytes it held when parked.
type Ended = io::Result<Option<Vec<u8>>>;

pin_project_lite::pin_project! {
    /// Both directions of a connection ([`bidirectional`]).
    struct Both<'a, U, D> {
        #[pin]
        up: U,
        #[pin]
        down: D,
        client: &'a TcpStream,
        backend: &'a TcpStream,
        up_ended: Option<Ended>,
        down_ended: Option<Ended>,
        // Set once a direction failed: how long the other may go on.
        grace: Option<Pin<Box<tokio::time::Sleep>>>,
    }
}

impl<U, D> Future for Both<'_, U, D>
where
    U: Future<Output = Ended>,
    D: Future<Output = Ended>,
{
    type Output = io::Result<Copied>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if this.up_ended.is_none() {
            if let Poll::Ready(r) = this.up.poll(cx) {
                let r = settle(r, this.backend, this.down_ended.is_none());
                if r.is_err() {
                    // Our write to the backend failed: its last answers may still be on their
                    // way to the client.
                    start_grace(this.grace);
                }
                *this.up_ended = Some(r);
            }
        }
        let mut given_up = false;
        if this.down_ended.is_none() {
            if let Poll::Ready(r) = this.down.poll(cx) {
                let r = settle(r, this.client, this.up_ended.is_none());
                if r.is_err() {
                    // A backend that reset the connection (its socket closed: no peer address)
                    // can take nothing more from the client: end now.
                    if this.backend.peer_addr().is_err() {
                        given_up = true;
                    } else {
                        start_grace(this.grace);
                    }
                }
                *this.down_ended = Some(r);
            }
        }
        let both = this.up_ended.is_some() && this.down_ended.is_some();
        given_up = given_up
            || match this.grace.as_mut() {
                Some(grace) if !both => grace.as_mut().poll(cx).is_ready(),
                _ => false,
            };
        if !both && !given_up {
            return Poll::Pending;
        }
        Poll::Ready(match (this.up_ended.take(), this.down_ended.take()) {
            (Some(Err(e)), _) | (_, Some(Err(e))) => Err(e),
            (Some(Ok(None)), Some(Ok(None))) => Ok(Copied::Done),
            (Some(Ok(up)), Some(Ok(down))) => Ok(Copied::Paused(Pending {
                up: up.unwrap_or_default(),
                down: down.unwrap_or_default(),
            })),
            _ => unreachable!("done with both results, or given up after an error"),
        })
    }
}

/// What a direction's end means for the connection: at EOF while the other direction goes on,
/// the half-close is passed on to `dst`.
fn settle(ended: Ended, dst: &TcpStream, other_goes_on: bool) -> Ended {
    match ended {
        Ok(None) if other_goes_on => socket2::SockRef::from(dst)
            .shutdown(std::net::Shutdown::Write)
            .or_else(ignore_not_connected)
            .map(|()| None),
        other => other,
    }
}

/// Starts the other direction's grace after one failed, once.
fn start_grace(grace: &mut Option<Pin<Box<tokio::time::Sleep>>>) {
    grace.get_or_insert_with(|| Box::pin(tokio::time::sleep(FAILED_GRACE)));
}

/// How long the other direction may go on after one failed (see [`bidirectional`]).
pub const FAILED_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// What one burst did.
#[derive(Debug, PartialEq, Eq)]
enum Burst {
    /// Moved this many bytes (0: the readiness was stale).
    Moved {
        bytes: usize,
        bulk: bool,
    },
    Eof,
    /// Paused with these bytes read but not written.
    Paused(Vec<u8>),
}

/// Waits until `ready` (a socket's readiness) unless the park signal comes first: `false`.
///
/// Only reads the flag: the caller of [`bidirectional`] registers the task's waker with the
/// control after each poll of the copy that returns pending, and polls the copy again if the
/// flag was raised (as `forward::carry` does), so a raise is never missed.
async fn ready_unless_parked<P>(
    pause: &Control<P>,
    mut ready: impl FnMut(&mut Context<'_>) -> Poll<io::Result<()>>,
) -> io::Result<bool> {
    std::future::poll_fn(|cx| {
        if pause.is_raised(Signal::PARK) {
            return Poll::Ready(Ok(false));
        }
        ready(cx).map_ok(|()| true)
    })
    .await
}

/// One direction — `initial` bytes first — until EOF (`None`) or until parked (`Some`: the
/// bytes read but not written). `turn` is given back once `src` is first readable (pace.rs:
/// the backend answered).
///
/// What EOF means for the connection is [`bidirectional`]'s (`settle`).
///
/// Written as a function returning an `async move` block rather than an `async fn`: an `async
/// fn` keeps its arguments twice in its state (as passed, and moved into its body), and this
/// state is held by every connection for its whole life, two per connection. The waits that
/// are rare (pending bytes of a handoff, a destination that cannot take a burst at once, a
/// splice) are boxed for the same reason ([`a_connection_future_stays_small`]).
///
/// [`a_connection_future_stays_small`]: crate::data::forward
#[allow(clippy::too_many_arguments)]
#[allow(clippy::manual_async_fn)] // an `async fn` would keep its arguments twice (copy::one_way)
fn one_way<'a, P>(
    src: &'a TcpStream,
    dst: &'a TcpStream,
    mode: Mode,
    counter: &'a Counter,
    initial: Vec<u8>,
    mut turn: Option<Turn>,
    pause: &'a Control<P>,
) -> impl Future<Output = Ended> + 'a
where
    P: 'a,
{
    async move {
        if !initial.is_empty() {
            if let Some(rest) = Box::pin(write_all(dst, &initial, pause)).await? {
                counter.add((initial.len() - rest.len()) as u64);
                return Ok(Some(rest));
            }
            counter.add(initial.len() as u64);
        }
        drop(initial);
        let mut bulk = mode == Mode::Splice;
        loop {
            if !ready_unless_parked(pause, |cx| src.poll_read_ready(cx)).await? {
                return Ok(Some(Vec::new()));
            }
            drop(turn.take());
            let burst = if bulk && mode != Mode::Buffered {
                match Pipe::take() {
                    Ok(pipe) => Box::pin(splice_burst(src, dst, pipe, counter, pause)).await?,
                    Err(e) => {
                        tracing::debug!(error = %e, "no pipe for splice: copying through a buffer");
                        buffered_burst(src, dst, counter, pause).await?
                    }
                }
            } else {
                buffered_burst(src, dst, counter, pause).await?
            };
            match burst {
                Burst::Eof => return Ok(None),
                Burst::Paused(rest) => return Ok(Some(rest)),
                Burst::Moved { bytes, bulk: big } => {
                    if mode == Mode::Auto && bytes > 0 {
                        bulk = big;
                    }
                }
            }
        }
    }
}

fn ignore_not_connected(e: io::Error) -> io::Result<()> {
    if e.kind() == io::ErrorKind::NotConnected {
        Ok(())
    } else {
        Err(e)
    }
}

/// What one read-and-forward step through the scratch buffer did.
enum Step {
    Eof,
    Empty,
    /// Read and wrote `read` bytes; `drained`: the socket had no more.
    Moved {
        read: usize,
        drained: bool,
    },
    /// Read `read` bytes; `rest` could not be written yet.
    Blocked {
        read: usize,
        drained: bool,
        rest: Vec<u8>,
    },
}

/// Reads once into the thread's scratch buffer and writes what it can at once.
///
/// A read shorter than the buffer drained the socket (edge-triggered epoll: new data brings a
/// new event), so readiness is cleared right away instead of by one more `recv` that would
/// only say `EAGAIN` — tokio's own `AsyncRead` does the same. That saves a system call per
/// message on request/response traffic.
fn read_and_forward(src: &TcpStream, dst: &TcpStream) -> io::Result<Step> {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        let len = buf.len();
        let mut n = 0;
        let read = src.try_io(Interest::READABLE, || {
            n = recv(src.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(io::Error::from)?;
            if 0 < n && n < len {
                // Drained: report WouldBlock so tokio clears the readiness we consumed.
                return Err(io::ErrorKind::WouldBlock.into());
            }
            Ok(())
        });
        match read {
            Ok(()) if n == 0 => return Ok(Step::Eof),
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock && n > 0 => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Step::Empty),
            Err(e) => return Err(e),
        }
        let drained = n < len;
        let mut written = 0;
        while written < n {
            match dst.try_write(&buf[written..n]) {
                Ok(m) => written += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    return Ok(Step::Blocked {
                        read: n,
                        drained,
                        rest: buf[written..n].to_vec(),
                    })
                }
                Err(e) => return Err(e),
            }
        }
        Ok(Step::Moved { read: n, drained })
    })
}

/// How a run of [`read_and_forward`] steps ended.
enum Buffered {
    Ended(Burst),
    /// The last step read `read` bytes; `rest` of them could not be written yet.
    Blocked {
        read: usize,
        drained: bool,
        rest: Vec<u8>,
    },
}

/// Steps through the scratch buffer while they move everything they read at once (nothing to
/// wait for); `moved` and `bulk` are the burst's so far.
fn buffered_steps(
    src: &TcpStream,
    dst: &TcpStream,
    counter: &Counter,
    moved: &mut usize,
    bulk: &mut bool,
) -> io::Result<Buffered> {
    loop {
        match read_and_forward(src, dst)? {
            Step::Eof => return Ok(Buffered::Ended(Burst::Eof)),
            Step::Empty => {
                return Ok(Buffered::Ended(Burst::Moved {
                    bytes: *moved,
                    bulk: *bulk,
                }))
            }
            Step::Moved { read, drained } => {
                counter.add(read as u64);
                *moved += read;
                *bulk |= read == SCRATCH_LEN;
                if drained {
                    return Ok(Buffered::Ended(Burst::Moved {
                        bytes: *moved,
                        bulk: *bulk,
                    }));
                }
            }
            Step::Blocked {
                read,
                drained,
                rest,
            } => {
                return Ok(Buffered::Blocked {
                    read,
                    drained,
                    rest,
                })
            }
        }
    }
}

/// Moves what is readable now from `src` to `dst` through the scratch buffer. (An `async move`
/// block, and the rare wait boxed: see [`one_way`].)
#[allow(clippy::manual_async_fn)] // an `async fn` would keep its arguments twice (copy::one_way)
fn buffered_burst<'a, P>(
    src: &'a TcpStream,
    dst: &'a TcpStream,
    counter: &'a Counter,
    pause: &'a Control<P>,
) -> impl Future<Output = io::Result<Burst>> + 'a
where
    P: 'a,
{
    async move {
        let (mut moved, mut bulk) = (0, false);
        loop {
            let (read, drained, rest) =
                match buffered_steps(src, dst, counter, &mut moved, &mut bulk)? {
                    Buffered::Ended(burst) => return Ok(burst),
                    Buffered::Blocked {
                        read,
                        drained,
                        rest,
                    } => (read, drained, rest),
                };
            if let Some(left) = Box::pin(write_all(dst, &rest, pause)).await? {
                counter.add((read - left.len()) as u64);
                return Ok(Burst::Paused(left));
            }
            counter.add(read as u64);
            moved += read;
            bulk |= read == SCRATCH_LEN;
            if drained {
                return Ok(Burst::Moved { bytes: moved, bulk });
            }
        }
    }
}

/// Writes all of `data`, unless parked first: then returns what is left.
async fn write_all<P>(
    dst: &TcpStream,
    mut data: &[u8],
    pause: &Control<P>,
) -> io::Result<Option<Vec<u8>>> {
    while !data.is_empty() {
        if !ready_unless_parked(pause, |cx| dst.poll_write_ready(cx)).await? {
            return Ok(Some(data.to_vec()));
        }
        match dst.try_write(data) {
            Ok(m) => data = &data[m..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(None)
}

/// Reads the `len` bytes left in `pipe` (spliced in, not yet out) into memory.
fn drain_pipe(pipe: &Pipe, len: usize) -> io::Result<Vec<u8>> {
    let mut out = vec![0u8; len];
    let mut got = 0;
    while got < len {
        match nix::unistd::read(pipe.read.as_raw_fd(), &mut out[got..]) {
            Ok(0) => break,
            Ok(m) => got += m,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    if got != len {
        return Err(io::Error::other(format!(
            "pipe held {got} bytes where {len} were spliced in"
        )));
    }
    Ok(out)
}

/// Splices what is readable now from `src` into `dst` through `pipe`.
async fn splice_burst<P>(
    src: &TcpStream,
    dst: &TcpStream,
    pipe: Pipe,
    counter: &Counter,
    pause: &Control<P>,
) -> io::Result<Burst> {
    let flags = SpliceFFlags::SPLICE_F_NONBLOCK | SpliceFFlags::SPLICE_F_MOVE;
    let mut moved = 0;
    loop {
        let n = match src.try_io(Interest::READABLE, || {
            splice(
                src.as_fd(),
                None,
                pipe.write.as_fd(),
                None,
                SPLICE_CHUNK,
                flags,
            )
            .map_err(io::Error::from)
        }) {
            Ok(0) => {
                pipe.give_back();
                return Ok(Burst::Eof);
            }
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                pipe.give_back();
                return Ok(Burst::Moved {
                    bytes: moved,
                    bulk: moved >= SMALL_BURST,
                });
            }
            Err(e) => return Err(e),
        };
        let mut pending = n;
        while pending > 0 {
            if !ready_unless_parked(pause, |cx| dst.poll_write_ready(cx)).await? {
                counter.add((n - pending) as u64);
                let rest = drain_pipe(&pipe, pending)?;
                pipe.give_back();
                return Ok(Burst::Paused(rest));
            }
            match dst.try_io(Interest::WRITABLE, || {
                splice(pipe.read.as_fd(), None, dst.as_fd(), None, pending, flags)
                    .map_err(io::Error::from)
            }) {
                Ok(m) => pending -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        counter.add(n as u64);
        moved += n;
    }
}

/// Reads and discards whatever `src` has now, through the thread's scratch buffer (nothing is
/// held across a wait). `true`: `src` reached EOF.
pub fn discard(src: &TcpStream) -> io::Result<bool> {
    SCRATCH.with(|cell| {
        let mut buf = cell.borrow_mut();
        loop {
            match src.try_read(&mut buf) {
                Ok(0) => return Ok(true),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => return Err(e),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::data::control::Registry;
    use std::sync::atomic::Ordering;

    /// Two ends of one loopback connection: (connecting end, accepted end).
    async fn socket_pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (connected, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (connected.unwrap(), accepted.unwrap().0)
    }

    /// Byte `at + i` of a stream that `seed` tells apart from others (a prime period: a
    /// shifted, dropped or repeated chunk shows).
    fn pattern(at: u64, len: usize, seed: u64) -> Vec<u8> {
        (at..at + len as u64)
            .map(|i| ((i + seed) % 251) as u8)
            .collect()
    }

    /// A client and a backend with the copy between them: bytes go both ways byte-exact, the
    /// client's half-close reaches the backend (it reads EOF) while the backend goes on
    /// answering, and the backend's close ends the copy as done; the counters count every byte.
    #[tokio::test]
    async fn carries_bytes_both_ways_and_passes_the_half_close_on() {
        for mode in [Mode::Buffered, Mode::Splice, Mode::Auto] {
            let (client_app, client) = socket_pair().await;
            let (backend, backend_app) = socket_pair().await;
            let (up, down) = (Counter::default(), Counter::default());
            let registry = Registry::<()>::default();
            let registration = registry.register();
            let (counters, control) = ((&up, &down), registration.control());
            // The caller closes both sockets once the copy is done (that close sends the FIN
            // of the direction that ended last).
            let copy = async move {
                let copied = bidirectional(
                    &client,
                    &backend,
                    mode,
                    counters,
                    Pending::default(),
                    None,
                    control,
                )
                .await;
                drop((client, backend));
                copied
            };
            // A small request first, then bulk: both ways through `Auto`'s switch.
            let mut request = pattern(0, 100, 0);
            request.extend(pattern(100, 1 << 20, 0));
            let answer = pattern(0, 300 << 10, 7);
            let (mut client_read, mut client_write) = client_app.into_split();
            let (mut backend_read, mut backend_write) = backend_app.into_split();
            let client_side = async {
                client_write.write_all(&request).await?;
                client_write.shutdown().await?;
                let mut got = Vec::new();
                client_read.read_to_end(&mut got).await?;
                io::Result::Ok(got)
            };
            let backend_side = async {
                let mut got = Vec::new();
                // Ends only at the client's half-close, passed on by the copy.
                backend_read.read_to_end(&mut got).await?;
                backend_write.write_all(&answer).await?;
                backend_write.shutdown().await?;
                io::Result::Ok(got)
            };
            let (copied, client_got, backend_got) =
                tokio::time::timeout(Duration::from_secs(20), async {
                    tokio::join!(copy, client_side, backend_side)
                })
                .await
                .unwrap_or_else(|_| panic!("{mode:?}: stuck (a half-close not passed on?)"));
            assert_eq!(copied.unwrap(), Copied::Done, "{mode:?}");
            assert!(backend_got.unwrap() == request, "{mode:?}: request differs");
            assert!(client_got.unwrap() == answer, "{mode:?}: answer differs");
            assert_eq!(up.get(), request.len() as u64, "{mode:?}");
            assert_eq!(down.get(), answer.len() as u64, "{mode:?}");
        }
    }

    /// The backend reads nothing, so the copy fills it and then holds a burst it cannot write.
    /// Paused then, it returns those bytes: what reached the backend, then the bytes returned,
    /// then what the copy never read from the client are exactly what the client sent.
    /// A backend that resets the connection (a crash, or a listener closed with the connection
    /// still in its queue) ends the copy at once with the error: nothing the client sends can
    /// reach it any more, so the client is not kept waiting for [`FAILED_GRACE`].
    #[tokio::test]
    async fn a_backend_reset_ends_the_copy_at_once() {
        for mode in [Mode::Buffered, Mode::Splice, Mode::Auto] {
            let (mut client_app, client) = socket_pair().await;
            let (backend, mut backend_app) = socket_pair().await;
            let (up, down) = (Counter::default(), Counter::default());
            let registry = Registry::<()>::default();
            let registration = registry.register();
            let copy = bidirectional(
                &client,
                &backend,
                mode,
                (&up, &down),
                Pending::default(),
                None,
                registration.control(),
            );
            let backend_side = async {
                let mut request = [0u8; 4];
                backend_app.read_exact(&mut request).await?;
                // Closed with SO_LINGER 0: a reset, as the kernel sends for a crashed process
                // that left bytes unread.
                socket2::SockRef::from(&backend_app).set_linger(Some(Duration::ZERO))?;
                drop(backend_app);
                io::Result::Ok(())
            };
            client_app.write_all(b"PING").await.unwrap();
            let (copied, reset) =
                tokio::time::timeout(FAILED_GRACE / 2, async { tokio::join!(copy, backend_side) })
                    .await
                    .unwrap_or_else(|_| {
                        panic!("{mode:?}: the copy waited on after the backend's reset")
                    });
            reset.unwrap();
            let e = copied.expect_err("a reset is an error");
            assert_eq!(e.kind(), io::ErrorKind::ConnectionReset, "{mode:?}: {e}");
        }
    }

    #[tokio::test]
    async fn pause_returns_the_bytes_read_but_not_written() {
        for mode in [Mode::Buffered, Mode::Splice] {
            let (client_app, client) = socket_pair().await;
            let (backend, mut backend_app) = socket_pair().await;
            let (up, down) = (Counter::default(), Counter::default());
            let registry = Registry::<()>::default();
            let registration = registry.register();
            let control = registration.control();
            let (_client_read, mut client_write) = client_app.into_split();
            let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let writer = {
                let sent = sent.clone();
                tokio::spawn(async move {
                    let mut at = 0;
                    loop {
                        let n = client_write.write(&pattern(at, 16 << 10, 0)).await.unwrap();
                        at += n as u64;
                        sent.store(at, Ordering::SeqCst);
                    }
                })
            };
            let mut copy = Box::pin(bidirectional(
                &client,
                &backend,
                mode,
                (&up, &down),
                Pending::default(),
                None,
                control,
            ));
            // Until the backend is full: nothing more written to it for three checks in a row.
            let (mut last, mut still) = (0, 0);
            let started = std::time::Instant::now();
            while still < 3 {
                tokio::select! {
                    r = &mut copy => panic!("{mode:?}: the copy ended: {r:?}"),
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                let now = up.get();
                still = if now > 0 && now == last { still + 1 } else { 0 };
                last = now;
                assert!(
                    started.elapsed() < Duration::from_secs(20),
                    "{mode:?}: never full"
                );
            }
            control.raise(Signal::PARK);
            let copied = tokio::time::timeout(Duration::from_secs(5), &mut copy)
                .await
                .unwrap_or_else(|_| panic!("{mode:?}: not paused"))
                .unwrap();
            drop(copy);
            let Copied::Paused(pending) = copied else {
                panic!("{mode:?}: {copied:?}");
            };
            writer.abort();
            assert!(writer.await.unwrap_err().is_cancelled());
            let sent = sent.load(Ordering::SeqCst);
            assert!(
                !pending.up.is_empty(),
                "{mode:?}: no byte in flight returned"
            );
            assert!(pending.down.is_empty(), "{mode:?}");

            let mut delivered = vec![0; up.get() as usize];
            backend_app.read_exact(&mut delivered).await.unwrap();
            assert!(
                matches!(backend_app.try_read(&mut [0]), Err(e) if e.kind() == io::ErrorKind::WouldBlock),
                "{mode:?}: the backend got more than counted"
            );
            // The writer's end is closed: the client socket reads to EOF.
            let mut unread = Vec::new();
            loop {
                client.readable().await.unwrap();
                let mut buf = [0u8; 64 << 10];
                match client.try_read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => unread.extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{e}"),
                }
            }
            let mut all = delivered;
            all.extend_from_slice(&pending.up);
            all.extend_from_slice(&unread);
            assert_eq!(all.len() as u64, sent, "{mode:?}: bytes lost or added");
            assert!(
                all == pattern(0, sent as usize, 0),
                "{mode:?}: bytes out of order"
            );
        }
    }
}
