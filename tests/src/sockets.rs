//! Inspects the TCP sockets of another process (the proxy under test): for each connected TCP
//! socket, its addresses and the options the process set (`TCP_NODELAY`, `SO_KEEPALIVE`,
//! `TCP_USER_TIMEOUT`).
//!
//! It also plays a handoff peer that takes a proxy's listening socket ([`share_request`]).
//!
//! This is the one module with `unsafe`: `pidfd_open(2)` and `pidfd_getfd(2)` have no safe
//! wrapper in nix 0.29, so they are called through `libc::syscall`; descriptors received with
//! `SCM_RIGHTS` are read with `libc::recvmsg` and owned at once. Each call's arguments are
//! plain integers and the returned descriptor is owned at once by an `OwnedFd`. Needs Linux
//! ≥ 5.6 and ptrace permission over the target (a child of the test process running as the
//! same user qualifies).

#![allow(unsafe_code)]

use std::net::SocketAddr;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};

/// One connected TCP socket of the inspected process.
#[derive(Debug, Clone)]
pub struct TcpSocketInfo {
    /// Its fd number in the inspected process.
    pub fd: i32,
    /// Local address.
    pub local: SocketAddr,
    /// Peer address.
    pub peer: SocketAddr,
    /// `TCP_NODELAY`.
    pub nodelay: bool,
    /// `SO_KEEPALIVE`.
    pub keepalive: bool,
    /// `TCP_USER_TIMEOUT` (zero: unset).
    pub user_timeout: Duration,
}

fn owned(raw: libc::c_long, what: &str) -> Result<OwnedFd> {
    if raw < 0 {
        bail!("{what}: {}", std::io::Error::last_os_error());
    }
    let fd = i32::try_from(raw).context("fd out of range")?;
    // SAFETY: the syscall just returned this new descriptor; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The connected TCP sockets of process `pid` (listening and unconnected ones left out).
pub fn tcp_connections(pid: u32) -> Result<Vec<TcpSocketInfo>> {
    // SAFETY: plain integer arguments; the result is checked and owned by `owned`.
    let pidfd = owned(
        unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) },
        "pidfd_open",
    )?;
    let mut sockets = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).context("read /proc/PID/fd")? {
        let entry = entry?;
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().starts_with("socket:[") {
            continue;
        }
        let Ok(remote_fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        // SAFETY: plain integer arguments; the result is checked and owned by `owned`.
        let Ok(fd) = owned(
            unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), remote_fd, 0) },
            "pidfd_getfd",
        ) else {
            continue; // closed meanwhile
        };
        let socket = std::net::TcpStream::from(fd);
        let sock = socket2::SockRef::from(&socket);
        if sock.r#type().ok() != Some(socket2::Type::STREAM) {
            continue;
        }
        let (Ok(local), Ok(peer)) = (socket.local_addr(), socket.peer_addr()) else {
            continue; // listening, unconnected or not an inet socket
        };
        sockets.push(TcpSocketInfo {
            fd: remote_fd,
            local,
            peer,
            nodelay: socket.nodelay()?,
            keepalive: sock.keepalive()?,
            user_timeout: sock.tcp_user_timeout()?.unwrap_or_default(),
        });
    }
    Ok(sockets)
}

/// Acts as a handoff peer: asks the instance serving the Unix socket `socket` for its
/// listening sockets bound to `listen` (a protocol v2 `share_request`) and returns the
/// descriptors it sends. Tests use it to get hold of a proxy's shared listener.
pub fn share_request(socket: &std::path::Path, listen: SocketAddr) -> Result<Vec<OwnedFd>> {
    use std::io::Write as _;
    let mut stream = std::os::unix::net::UnixStream::connect(socket)
        .with_context(|| format!("connect {}", socket.display()))?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let payload = format!(r#"{{"type":"share_request","addrs":["{listen}"]}}"#);
    let mut frame = b"KAPH\x02\x00".to_vec();
    frame.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    frame.extend_from_slice(payload.as_bytes());
    stream.write_all(&frame)?;
    let mut buf = [0u8; 4096];
    let mut control = vec![0u64; 64];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() * 8;
    // SAFETY: `msg` points at `buf` and `control`, both alive and of the sizes given.
    let n = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n <= 0 {
        bail!("no answer: {}", std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the headers walked lie within `control` as filled by the kernel.
    let mut header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !header.is_null() {
        // SAFETY: as above.
        let h = unsafe { &*header };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: pure size computation.
            let len = h.cmsg_len as usize - unsafe { libc::CMSG_LEN(0) } as usize;
            // SAFETY: the payload lies within `control`.
            let data = unsafe { libc::CMSG_DATA(header) }.cast::<libc::c_int>();
            for i in 0..len / 4 {
                // SAFETY: a descriptor the kernel just installed for us, owned once here.
                fds.push(unsafe { OwnedFd::from_raw_fd(data.add(i).read_unaligned()) });
            }
        }
        // SAFETY: as above.
        header = unsafe { libc::CMSG_NXTHDR(&msg, header) };
    }
    let answer = String::from_utf8_lossy(&buf[..n as usize]).into_owned();
    if fds.is_empty() {
        bail!("no socket shared: {answer}");
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sees_own_connected_socket_options() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client.set_nodelay(true).unwrap();
        let (_server, _) = listener.accept().unwrap();
        let sockets = tcp_connections(std::process::id()).unwrap();
        let mine = sockets
            .iter()
            .find(|s| s.local == client.local_addr().unwrap())
            .expect("own client socket listed");
        assert!(mine.nodelay);
        assert!(!mine.keepalive);
        assert_eq!(mine.peer, listener.local_addr().unwrap());
    }
}
