//! Moving bytes both ways between client and backend, half-close aware, with no idle timeout.
//!
//! Two ways, chosen per connection:
//!
//! - **splice** (default): `splice(2)` from one socket into a pipe and from the pipe into the
//!   other socket; the bytes never enter user space. Pipes come from a small pool and are held
//!   only while data is in flight, so an idle connection holds no pipe (and no descriptors
//!   beyond its two sockets).
//! - **buffered**: `read`/`write` through a buffer that exists only while data is in flight.
//!   Used with `--splice=false`, and whenever no pipe can be had (e.g. out of descriptors).
//!
//! Either way an idle connection holds no user-space buffer. When one side reaches EOF the other
//! side's write half is shut down (half-close propagates) and the other direction goes on.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Mutex;

use nix::fcntl::{splice, OFlag, SpliceFFlags};
use prometheus::IntCounter;
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Bytes moved per `splice` call at most (the default pipe capacity).
const SPLICE_CHUNK: usize = 64 * 1024;
/// Size of the transient buffer of the buffered path.
const BUFFER_SIZE: usize = 16 * 1024;
/// Idle pipes kept for reuse; more are closed when returned.
const POOL_MAX: usize = 256;

/// A pipe used to splice one burst of data.
struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

static POOL: Mutex<Vec<Pipe>> = Mutex::new(Vec::new());

impl Pipe {
    fn take() -> io::Result<Pipe> {
        if let Some(p) = POOL.lock().expect("pipe pool").pop() {
            return Ok(p);
        }
        let (read, write) = nix::unistd::pipe2(OFlag::O_NONBLOCK | OFlag::O_CLOEXEC)?;
        Ok(Pipe { read, write })
    }

    /// Returns an empty pipe to the pool (a pipe with data left in it is closed instead).
    fn give_back(self) {
        let mut pool = POOL.lock().expect("pipe pool");
        if pool.len() < POOL_MAX {
            pool.push(self);
        }
    }
}

/// Idle pipes in the pool now (each holds two descriptors).
pub fn pooled_pipes() -> usize {
    POOL.lock().expect("pipe pool").len()
}

/// How to copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Splice,
    Buffered,
}

/// Copies both ways until both directions reached EOF, or either failed. Bytes are added to
/// the counters as they move.
pub async fn bidirectional(
    client: &TcpStream,
    backend: &TcpStream,
    mode: Mode,
    up: &IntCounter,
    down: &IntCounter,
) -> io::Result<()> {
    let upstream = one_way(client, backend, mode, up);
    let downstream = one_way(backend, client, mode, down);
    tokio::try_join!(upstream, downstream)?;
    Ok(())
}

/// One direction until EOF, then shuts down the write half of `dst`.
async fn one_way(
    src: &TcpStream,
    dst: &TcpStream,
    mode: Mode,
    counter: &IntCounter,
) -> io::Result<()> {
    let mut mode = mode;
    loop {
        src.readable().await?;
        let moved = match mode {
            Mode::Splice => match Pipe::take() {
                Ok(pipe) => splice_burst(src, dst, pipe, counter).await?,
                Err(e) => {
                    tracing::debug!(error = %e, "no pipe for splice: copying through a buffer");
                    mode = Mode::Buffered;
                    continue;
                }
            },
            Mode::Buffered => buffered_burst(src, dst, counter).await?,
        };
        if moved == Burst::Eof {
            socket2::SockRef::from(dst)
                .shutdown(std::net::Shutdown::Write)
                .or_else(ignore_not_connected)?;
            return Ok(());
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

#[derive(Debug, PartialEq, Eq)]
enum Burst {
    /// Moved data, or nothing was there after all (readiness was stale).
    Data,
    Eof,
}

/// Splices what is readable now from `src` into `dst` through `pipe`.
async fn splice_burst(
    src: &TcpStream,
    dst: &TcpStream,
    pipe: Pipe,
    counter: &IntCounter,
) -> io::Result<Burst> {
    let flags = SpliceFFlags::SPLICE_F_NONBLOCK | SpliceFFlags::SPLICE_F_MOVE;
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
                return Ok(Burst::Data);
            }
            Err(e) => return Err(e),
        };
        let mut pending = n;
        while pending > 0 {
            dst.writable().await?;
            match dst.try_io(Interest::WRITABLE, || {
                splice(pipe.read.as_fd(), None, dst.as_fd(), None, pending, flags)
                    .map_err(io::Error::from)
            }) {
                Ok(m) => pending -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        counter.inc_by(n as u64);
    }
}

/// Reads what is readable now from `src` and writes it to `dst` through a transient buffer.
async fn buffered_burst(
    src: &TcpStream,
    dst: &TcpStream,
    counter: &IntCounter,
) -> io::Result<Burst> {
    let mut buf = vec![0u8; BUFFER_SIZE];
    loop {
        let n = match src.try_read(&mut buf) {
            Ok(0) => return Ok(Burst::Eof),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Burst::Data),
            Err(e) => return Err(e),
        };
        let mut written = 0;
        while written < n {
            dst.writable().await?;
            match dst.try_write(&buf[written..n]) {
                Ok(m) => written += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        counter.inc_by(n as u64);
    }
}
