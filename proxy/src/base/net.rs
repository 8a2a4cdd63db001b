//! TCP socket settings: the public listener and both sides of every proxied connection.
//!
//! No idle timeout anywhere: watches, `logs -f` and `exec` live for hours. Dead peers are found
//! by TCP keepalive and `TCP_USER_TIMEOUT` instead.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use socket2::{Domain, SockRef, Socket, TcpKeepalive, Type};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// Idle time before the first keepalive probe.
pub const KEEPALIVE_TIME: Duration = Duration::from_secs(30);
/// Time between keepalive probes.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// Unanswered probes before the connection is dropped.
pub const KEEPALIVE_RETRIES: u32 = 3;
/// How long sent data may stay unacknowledged before the kernel drops the connection.
pub const USER_TIMEOUT: Duration = Duration::from_secs(60);
/// Accept backlog of the public listener (capped by `net.core.somaxconn`).
pub const LISTEN_BACKLOG: i32 = 4096;

/// Sets keepalive, `TCP_USER_TIMEOUT` and `TCP_NODELAY` on one side of a proxied connection.
pub fn tune(stream: &TcpStream) -> io::Result<()> {
    tune_socket(SockRef::from(stream))
}

/// Sets the options of the backend side of a proxied connection. To a loopback backend (the
/// pod's own apiserver): `TCP_NODELAY` and `TCP_USER_TIMEOUT` only, two system calls instead
/// of six, because keepalive cannot find anything there: this host's kernel answers the probes
/// for any socket that is open, whatever its process does, and resets or closes the sockets of
/// a process that dies. (`TCP_USER_TIMEOUT` still bounds a backend that stops reading: its
/// window stays closed.) Other backends get every option of [`tune`].
pub fn tune_backend(stream: &TcpStream, backend: SocketAddr) -> io::Result<()> {
    if !backend.ip().is_loopback() {
        return tune(stream);
    }
    let sock = SockRef::from(stream);
    sock.set_nodelay(true)?;
    sock.set_tcp_user_timeout(Some(USER_TIMEOUT))
}

/// Sets the connection options on a listening socket: accepted connections inherit them from
/// it (Linux copies `TCP_NODELAY`, keepalive and `TCP_USER_TIMEOUT` to the child socket), so
/// the accept path makes no `setsockopt` calls of its own.
pub fn tune_listener(listener: &impl std::os::fd::AsFd) -> io::Result<()> {
    tune_socket(SockRef::from(listener))
}

fn tune_socket(sock: SockRef<'_>) -> io::Result<()> {
    sock.set_nodelay(true)?;
    sock.set_tcp_keepalive(
        &TcpKeepalive::new()
            .with_time(KEEPALIVE_TIME)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_RETRIES),
    )?;
    sock.set_tcp_user_timeout(Some(USER_TIMEOUT))?;
    Ok(())
}

/// Binds a fresh public listener with `SO_REUSEPORT`, so peers can bind the same address.
pub fn bind_reuseport(addr: SocketAddr) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM.cloexec(), None)?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

/// Connects to `addr` within `timeout`.
///
/// The outcome is read from the readiness the event loop reports: a connect that succeeded
/// makes the socket writable; one that failed also reports an error (`EPOLLERR`), and only
/// then is the error read (`SO_ERROR`). Tokio's `TcpStream::connect` reads `SO_ERROR` after
/// every connect: one system call per connection more.
pub async fn connect(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    connect_socket(socket, addr, timeout).await
}

/// Connects to `addr` within `timeout` from `source`, an address that need not be this host's
/// (`IP_TRANSPARENT`, `--client-address transparent`); the port is chosen at connect time, so
/// any number of connections may share one source address. Three system calls more than
/// [`connect`]: two socket options and the bind.
pub async fn connect_from(
    source: std::net::IpAddr,
    addr: SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let socket = transparent_socket(source, addr)?;
    connect_socket(socket, addr, timeout).await
}

/// The socket of [`connect_from`], bound to `source`, not yet connected.
pub fn transparent_socket(source: std::net::IpAddr, addr: SocketAddr) -> io::Result<Socket> {
    let socket = Socket::new(
        Domain::for_address(addr),
        Type::STREAM.nonblocking().cloexec(),
        None,
    )?;
    crate::sys::set_transparent(std::os::fd::AsFd::as_fd(&socket))?;
    socket.bind(&SocketAddr::new(source, 0).into())?;
    Ok(socket)
}

/// Connects `socket` (non-blocking, not yet connected) to `addr` within `timeout`, as
/// [`connect`] does.
pub async fn connect_socket(
    socket: Socket,
    addr: SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    match socket.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from_std(socket.into())?;
    let ready = tokio::time::timeout(timeout, stream.ready(Interest::WRITABLE | Interest::ERROR))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    if ready.is_error() || ready.is_write_closed() {
        return Err(stream.take_error()?.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::ConnectionAborted, "connect failed")
        }));
    }
    Ok(stream)
}

/// True when an error means this process is out of descriptors or memory: not the peer's fault.
pub fn is_local_exhaustion(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The outcome read from the readiness: connected, refused (the kernel's own error), or no
    /// answer within the timeout.
    #[tokio::test]
    async fn connect_tells_connected_refused_and_timed_out_apart() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let stream = connect(addr, Duration::from_secs(10)).await.unwrap();
        assert_eq!(stream.peer_addr().unwrap(), addr);
        drop((stream, listener));
        let refused = connect(addr, Duration::from_secs(10)).await.unwrap_err();
        assert_eq!(
            refused.kind(),
            io::ErrorKind::ConnectionRefused,
            "{refused}"
        );

        // A listener whose accept queue is full drops the handshake: no answer.
        let full = Socket::new(Domain::IPV4, Type::STREAM, None).unwrap();
        full.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())
            .unwrap();
        full.listen(0).unwrap();
        let addr = full.local_addr().unwrap().as_socket().unwrap();
        let _queued = std::net::TcpStream::connect(addr).unwrap();
        let silent = connect(addr, Duration::from_millis(300)).await.unwrap_err();
        assert_eq!(silent.kind(), io::ErrorKind::TimedOut, "{silent}");
    }
}
