//! The one module with `unsafe`: raw file-descriptor and socket work for the listener
//! handoff.
//!
//! Why `unsafe` is needed here and nowhere else:
//! - File descriptors received with `SCM_RIGHTS` arrive as raw integers; turning them into
//!   `OwnedFd` (so they are closed exactly once) is `unsafe` by nature. It is done immediately
//!   on receipt, for every descriptor, before anything can fail — also when the control message
//!   was truncated, which nix's safe iterator would not let us see (so `recvmsg` and the
//!   `CMSG_*` walk are done with libc here).
//! - The in-place upgrade passes the admin listening socket to the successor process by
//!   inheritance: clearing `CLOEXEC` in the forked child before `exec` needs `pre_exec`, and the
//!   successor turns the inherited descriptor number back into an `OwnedFd`.
//! - `migrate` duplicates kube-apiserver's listening socket out of its process with
//!   `pidfd_open` and `pidfd_getfd`, which have no safe wrapper in nix or libc.
//! - `migrate-back` attaches a classic BPF socket filter (`SO_ATTACH_FILTER`, whose argument
//!   points at the program) to a listening socket it is about to close.
//! - `run --user` keeps one capability across the switch to an unprivileged uid
//!   ([`keep_only_capabilities`]): `capset(2)` and the ambient set (`prctl(PR_CAP_AMBIENT)`)
//!   have no wrapper in nix.
//! - `--worker-slice` asks the scheduler for a shorter slice for the worker threads
//!   ([`set_thread_slice`]): `sched_setattr(2)` and `sched_getattr(2)` have no wrapper in nix
//!   or libc.
//!
//! Everything else (credentials, socket type and state, addresses, `IP_TRANSPARENT`) uses nix's
//! safe API.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{
    getsockopt, sendmsg, sockopt, ControlMessage, MsgFlags, SockType, UnixCredentials,
};

/// Most descriptors one handoff message may carry.
pub const MAX_FDS: usize = 64;

/// What identifies one socket across processes: its cookie and its inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct SocketIdentity {
    pub cookie: u64,
    pub inode: u64,
}

/// Reads a socket's cookie (`SO_COOKIE`, Linux 4.13+): the kernel's number for it, unique for
/// the boot.
pub fn cookie(fd: BorrowedFd<'_>) -> io::Result<u64> {
    socket2::SockRef::from(&fd).cookie()
}

/// Reads the identity of a socket.
pub fn identity(fd: BorrowedFd<'_>) -> io::Result<SocketIdentity> {
    let cookie = cookie(fd)?;
    let stat = nix::sys::stat::fstat(fd.as_raw_fd())?;
    Ok(SocketIdentity {
        cookie,
        inode: stat.st_ino,
    })
}

/// Checks that `fd` is a listening TCP socket and returns its bound address.
pub fn listening_tcp_addr(fd: BorrowedFd<'_>) -> io::Result<SocketAddr> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_string());
    if getsockopt(&fd, sockopt::SockType).map_err(|_| bad("not a socket"))? != SockType::Stream {
        return Err(bad("not a stream socket"));
    }
    if !getsockopt(&fd, sockopt::AcceptConn)? {
        return Err(bad("socket is not listening"));
    }
    socket2::SockRef::from(&fd)
        .local_addr()?
        .as_socket()
        .ok_or_else(|| bad("not an IP socket"))
}

/// Checks that `fd` is a connected TCP socket and returns its local and peer addresses.
pub fn connected_tcp_addrs(fd: BorrowedFd<'_>) -> io::Result<(SocketAddr, SocketAddr)> {
    let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_string());
    if getsockopt(&fd, sockopt::SockType).map_err(|_| bad("not a socket"))? != SockType::Stream {
        return Err(bad("not a stream socket"));
    }
    if getsockopt(&fd, sockopt::AcceptConn)? {
        return Err(bad("socket is listening"));
    }
    let sock = socket2::SockRef::from(&fd);
    let local = sock
        .local_addr()?
        .as_socket()
        .ok_or_else(|| bad("not an IP socket"))?;
    let peer = sock
        .peer_addr()?
        .as_socket()
        .ok_or_else(|| bad("not an IP socket"))?;
    Ok((local, peer))
}

/// The credentials of the peer of a connected Unix socket.
pub fn peer_credentials(fd: BorrowedFd<'_>) -> io::Result<UnixCredentials> {
    Ok(getsockopt(&fd, sockopt::PeerCredentials)?)
}

/// Sends `bytes` with `fds` attached (`SCM_RIGHTS`) on a connected Unix stream socket.
/// Returns the bytes sent (the descriptors travel with the first byte).
pub fn send_with_fds(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    let raw: Vec<RawFd> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let cmsgs: Vec<ControlMessage<'_>> = if raw.is_empty() {
        Vec::new()
    } else {
        vec![ControlMessage::ScmRights(&raw)]
    };
    let iov = [IoSlice::new(bytes)];
    Ok(sendmsg::<()>(
        sock.as_raw_fd(),
        &iov,
        &cmsgs,
        MsgFlags::MSG_NOSIGNAL,
        None,
    )?)
}

/// Receives bytes and any descriptors from a Unix stream socket. Every received descriptor is
/// owned at once (closed on drop) and carries `CLOEXEC` (`MSG_CMSG_CLOEXEC`). The control
/// buffer holds the kernel's maximum ([`SCM_MAX_FD`]), so no peer can make it truncate; a
/// truncated control message is still an error, after the descriptors that did arrive are owned
/// (and so closed).
pub fn recv_with_fds(sock: BorrowedFd<'_>, buf: &mut [u8]) -> io::Result<(usize, Vec<OwnedFd>)> {
    recv_with_fds_upto(sock, buf, SCM_MAX_FD)
}

/// Most descriptors the kernel passes in one `SCM_RIGHTS` message (`SCM_MAX_FD`).
pub const SCM_MAX_FD: usize = 253;

fn recv_with_fds_upto(
    sock: BorrowedFd<'_>,
    buf: &mut [u8],
    max_fds: usize,
) -> io::Result<(usize, Vec<OwnedFd>)> {
    // nix's `RecvMsg::cmsgs` refuses to iterate a truncated control buffer, which would leave
    // the descriptors the kernel did install unowned: parse the headers here instead.
    let data_len = (max_fds * std::mem::size_of::<RawFd>()) as libc::c_uint;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(data_len) } as usize;
    // u64 elements: the buffer is aligned for `cmsghdr`.
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: `msg` points at `iov` (valid for `buf.len()` bytes) and at `control` (valid for
    // `space` bytes), both alive for the call.
    let n = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: `msg` was filled by the kernel; CMSG_FIRSTHDR/CMSG_NXTHDR stay within
    // `msg_controllen`, which the kernel set to what it wrote.
    let mut header = unsafe { libc::CMSG_FIRSTHDR(&msg) };
    while !header.is_null() {
        // SAFETY: non-null headers returned by CMSG_FIRSTHDR/CMSG_NXTHDR lie within `control`.
        let h = unsafe { &*header };
        if h.cmsg_level == libc::SOL_SOCKET && h.cmsg_type == libc::SCM_RIGHTS {
            // SAFETY: pure size computation.
            let payload = h.cmsg_len as usize - unsafe { libc::CMSG_LEN(0) } as usize;
            // SAFETY: the payload of this header lies within `control`.
            let data = unsafe { libc::CMSG_DATA(header) }.cast::<RawFd>();
            for i in 0..payload / std::mem::size_of::<RawFd>() {
                // SAFETY: `i` is within the payload; it may be unaligned, so read it so. The
                // kernel just installed this descriptor in our table for this message; nothing
                // else owns it, and it is wrapped exactly once here.
                fds.push(unsafe { OwnedFd::from_raw_fd(data.add(i).read_unaligned()) });
            }
        }
        // SAFETY: as above.
        header = unsafe { libc::CMSG_NXTHDR(&msg, header) };
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        // `fds` is dropped here: what arrived is closed.
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "control message truncated",
        ));
    }
    Ok((n as usize, fds))
}

/// Makes `fd` survive the `exec` of `command` (at the same number) without ever clearing
/// `CLOEXEC` in this process, where another thread's spawn could leak it.
pub fn keep_across_exec(command: &mut std::process::Command, fd: BorrowedFd<'_>) {
    use std::os::unix::process::CommandExt;
    let raw = fd.as_raw_fd();
    // SAFETY: the closure runs in the forked child before exec and calls only `fcntl`, which
    // is async-signal-safe; it touches no memory of the parent. `raw` stays open in the parent
    // until the spawn returns (the caller holds the borrow), so the child has it too.
    unsafe {
        command.pre_exec(move || {
            let flags = libc::fcntl(raw, libc::F_GETFD);
            if flags < 0 || libc::fcntl(raw, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Takes ownership of a listening TCP socket inherited at descriptor number `raw` (see
/// [`keep_across_exec`]) and returns it with `CLOEXEC` set. A number that is not open, or not a
/// listening TCP socket, is left alone (it is not ours to close) and is an error.
pub fn take_inherited_listener(raw: RawFd) -> io::Result<(OwnedFd, SocketAddr)> {
    if raw <= 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not an inherited descriptor",
        ));
    }
    // SAFETY: F_GETFD only reads the descriptor flags; an unknown number gives EBADF.
    if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is open (checked just above) and nothing closes it while borrowed here.
    let borrowed = unsafe { BorrowedFd::borrow_raw(raw) };
    let addr = listening_tcp_addr(borrowed)?;
    // SAFETY: a listening TCP socket at this number, named to us by our parent for us to own,
    // exists in no other object of this process (nothing else in it opens listening sockets
    // before the admin endpoint is set up): it is wrapped exactly once.
    let owned = unsafe { OwnedFd::from_raw_fd(raw) };
    nix::fcntl::fcntl(
        owned.as_raw_fd(),
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )?;
    Ok((owned, addr))
}

/// Duplicates descriptor `fd` of process `pid` into this process (`pidfd_open` +
/// `pidfd_getfd`, Linux 5.6+), with `CLOEXEC` set. Needs ptrace access to the target
/// (`CAP_SYS_PTRACE`, or the same uid under a permissive Yama scope). Used by `migrate` to
/// reach the listening socket of a running kube-apiserver.
pub fn take_fd_of(pid: u32, fd: RawFd) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "pid out of range"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1; no memory
    // is passed.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a descriptor just returned to us by the kernel, owned by nothing else.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd takes a pidfd, a descriptor number in the target and flags (must be
    // 0); it returns a new descriptor (with CLOEXEC) or -1. No memory is passed.
    let taken = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0) };
    if taken < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above, a fresh descriptor owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(taken as RawFd) })
}

/// Makes a listening TCP socket drop every new connection attempt (a SYN without ACK) while it
/// still completes the handshakes already under way: a classic BPF filter on the socket
/// (`SO_ATTACH_FILTER`; the kernel runs it on every segment for the socket, with the TCP header
/// at offset 0). A dropped SYN is sent again by the client (after 1 s on Linux) and then finds
/// whatever listens once this socket is closed; closing a listener with an empty queue resets
/// nothing. The kernel of the tiers' machines (6.18) asks for `CAP_NET_ADMIN` (EPERM without
/// it); `migrate-back` runs as root.
pub fn drop_new_connections(fd: BorrowedFd<'_>) -> io::Result<()> {
    // ldb [13]            TCP flags
    // and #0x12           SYN | ACK
    // jeq #0x02, 0, 1     SYN alone?
    // ret #0              drop
    // ret #0xffffffff     keep
    let program = [
        libc::sock_filter {
            code: 0x30,
            jt: 0,
            jf: 0,
            k: 13,
        },
        libc::sock_filter {
            code: 0x54,
            jt: 0,
            jf: 0,
            k: 0x12,
        },
        libc::sock_filter {
            code: 0x15,
            jt: 0,
            jf: 1,
            k: 0x02,
        },
        libc::sock_filter {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: 0,
        },
        libc::sock_filter {
            code: 0x06,
            jt: 0,
            jf: 0,
            k: u32::MAX,
        },
    ];
    let fprog = libc::sock_fprog {
        len: program.len() as libc::c_ushort,
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `fprog` points at `program`, both alive for the call; the kernel copies the
    // program and reads nothing after returning.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            &fprog as *const libc::sock_fprog as *const libc::c_void,
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Makes `socket` able to bind an address that is not this host's (`IP_TRANSPARENT`, which
/// needs `CAP_NET_RAW` or `CAP_NET_ADMIN`), and leaves the choice of its port to `connect`
/// (`IP_BIND_ADDRESS_NO_PORT`: binding port 0 reserves no port, so a client's address can be
/// bound by any number of connections at once). Both are `SOL_IP` options; the kernel takes
/// them on IPv6 sockets too.
pub fn set_transparent(socket: BorrowedFd<'_>) -> io::Result<()> {
    nix::sys::socket::setsockopt(&socket, sockopt::IpTransparent, &true)?;
    nix::sys::socket::setsockopt(&socket, sockopt::IpBindAddressNoPort, &true)?;
    Ok(())
}

/// `CAP_NET_RAW`: what `IP_TRANSPARENT` needs (or `CAP_NET_ADMIN`).
pub const CAP_NET_RAW: u32 = 13;

const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
const PR_CAP_AMBIENT: libc::c_int = 47;
const PR_CAP_AMBIENT_RAISE: libc::c_ulong = 2;

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Default, Clone, Copy)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The calling thread's effective and permitted capability sets, as masks of `1 << CAP_*`.
pub fn capabilities() -> io::Result<(u64, u64)> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: capget reads `header` and writes two `CapData` (version 3), both valid here.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let join = |f: fn(&CapData) -> u32| u64::from(f(&data[0])) | (u64::from(f(&data[1])) << 32);
    Ok((join(|d| d.effective), join(|d| d.permitted)))
}

/// Sets the calling thread's effective, permitted and inheritable capabilities to exactly
/// `caps` (a mask of `1 << CAP_*`) and raises each of them in the ambient set, so they survive
/// `execve` of a binary without file capabilities (the successor of an in-place upgrade).
/// Fails with `EPERM` when `caps` holds one the thread is not permitted. Call it while the
/// process has one thread: capabilities belong to threads.
pub fn keep_only_capabilities(caps: u64) -> io::Result<()> {
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let word = |shift: u32| (caps >> shift) as u32;
    let data = [
        CapData {
            effective: word(0),
            permitted: word(0),
            inheritable: word(0),
        },
        CapData {
            effective: word(32),
            permitted: word(32),
            inheritable: word(32),
        },
    ];
    // SAFETY: capset reads `header` and two `CapData` (version 3), both valid for the call.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut header, data.as_ptr()) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    for cap in (0..64).filter(|c| caps & (1u64 << c) != 0) {
        // SAFETY: prctl with integer arguments only.
        let r = unsafe {
            libc::prctl(
                PR_CAP_AMBIENT,
                PR_CAP_AMBIENT_RAISE,
                cap as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// `struct sched_attr` of `sched_setattr(2)` (its first version, 56 bytes).
#[repr(C)]
#[derive(Default)]
struct SchedAttr {
    size: u32,
    policy: u32,
    flags: u64,
    nice: i32,
    priority: u32,
    runtime: u64,
    deadline: u64,
    period: u64,
    util_min: u32,
    util_max: u32,
}

fn sched_getattr() -> io::Result<SchedAttr> {
    let mut attr = SchedAttr::default();
    // SAFETY: the kernel writes at most `size` (the struct's own size) bytes into `attr`.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut attr as *mut SchedAttr,
            std::mem::size_of::<SchedAttr>() as libc::c_uint,
            0,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(attr)
}

/// The calling thread's scheduling slice as the kernel reports it: `Some` for a thread of the
/// normal policy on a kernel that reports one (EEVDF, Linux 6.12 and later: its own slice if
/// it asked for one, else the default), `None` otherwise.
pub fn thread_slice() -> io::Result<Option<std::time::Duration>> {
    let attr = sched_getattr()?;
    Ok(
        (attr.policy == libc::SCHED_OTHER as u32 && attr.runtime > 0)
            .then(|| std::time::Duration::from_nanos(attr.runtime)),
    )
}

/// Asks the scheduler for a slice of `slice` for the calling thread, keeping its policy and
/// nice value: a woken thread with a short slice gets an early deadline and runs before a
/// thread that has used the CPU for long (EEVDF: `sched_attr.sched_runtime` of a
/// `SCHED_OTHER` thread, Linux 6.12 and later, 0.1 to 100 ms). Only for a thread of the normal
/// policy (one the operator set to another is left alone: `Ok(false)`). Earlier kernels take
/// the call and ignore the slice; [`thread_slice`] tells.
pub fn set_thread_slice(slice: std::time::Duration) -> io::Result<bool> {
    let mut attr = sched_getattr()?;
    if attr.policy != libc::SCHED_OTHER as u32 {
        return Ok(false);
    }
    attr.flags = 0;
    attr.runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
    sched_setattr(attr)?;
    Ok(true)
}

/// `sched_setattr(2)` for the calling thread.
fn sched_setattr(mut attr: SchedAttr) -> io::Result<()> {
    attr.size = std::mem::size_of::<SchedAttr>() as u32;
    // SAFETY: `attr` is a valid `struct sched_attr` of `size` bytes, only read by the kernel.
    let r = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Reads `net.ipv4.tcp_migrate_req`; `None` when the kernel has no such sysctl.
pub fn tcp_migrate_req() -> Option<i64> {
    std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req")
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    /// A thread that asks for a slice has it, and asking changes no other thread's; a thread
    /// of another policy is left alone.
    #[test]
    fn a_thread_gets_the_slice_it_asks_for() {
        let wanted = std::time::Duration::from_micros(200);
        let before = std::thread::spawn(thread_slice).join().unwrap().unwrap();
        if before.is_none() {
            let reason = "this kernel reports no scheduling slice (EEVDF slices: Linux 6.12)";
            assert!(std::env::var_os("CI").is_none(), "{reason}");
            eprintln!("SKIPPED: {reason}");
            return;
        }
        assert_ne!(before, Some(wanted), "the default slice is another");
        let (set, after) = std::thread::spawn(move || {
            let set = set_thread_slice(wanted).unwrap();
            (set, thread_slice().unwrap())
        })
        .join()
        .unwrap();
        assert!(set);
        assert_eq!(after, Some(wanted));
        let other = std::thread::spawn(thread_slice).join().unwrap().unwrap();
        assert_eq!(other, before, "another thread keeps the default");
        let batch = std::thread::spawn(move || {
            let mut attr = sched_getattr().unwrap();
            attr.policy = libc::SCHED_BATCH as u32;
            attr.runtime = 0;
            sched_setattr(attr).unwrap();
            set_thread_slice(wanted).unwrap()
        })
        .join()
        .unwrap();
        assert!(!batch, "a SCHED_BATCH thread is left alone");
    }

    #[test]
    fn fds_travel_with_cloexec_and_keep_identity() {
        let listener = crate::base::net::bind_reuseport("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        send_with_fds(a.as_fd(), b"x", &[listener.as_fd()]).unwrap();
        let mut buf = [0u8; 8];
        let (n, fds) = recv_with_fds(b.as_fd(), &mut buf).unwrap();
        assert_eq!((n, fds.len()), (1, 1));
        let flags = nix::fcntl::fcntl(fds[0].as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert!(flags & libc::FD_CLOEXEC != 0);
        assert_eq!(
            identity(fds[0].as_fd()).unwrap(),
            identity(listener.as_fd()).unwrap()
        );
        assert_eq!(listening_tcp_addr(fds[0].as_fd()).unwrap(), addr);
    }

    /// More descriptors than the control buffer holds: the call fails, and the descriptors
    /// that did arrive are closed, not leaked (a leaked listener would stay in the reuseport
    /// group with nobody accepting: its share of new connections would time out).
    #[test]
    fn truncated_descriptors_are_closed_not_leaked() {
        // Room for one descriptor is room for two after alignment: send three.
        let listeners: Vec<_> = (0..3)
            .map(|_| crate::base::net::bind_reuseport("127.0.0.1:0".parse().unwrap()).unwrap())
            .collect();
        let addrs: Vec<_> = listeners.iter().map(|l| l.local_addr().unwrap()).collect();
        let (a, b) = UnixStream::pair().unwrap();
        let fds: Vec<_> = listeners.iter().map(|l| l.as_fd()).collect();
        send_with_fds(a.as_fd(), b"x", &fds).unwrap();
        drop(listeners);
        let mut buf = [0u8; 8];
        let err = recv_with_fds_upto(b.as_fd(), &mut buf, 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        for addr in addrs {
            let connect = std::net::TcpStream::connect(addr);
            assert_eq!(
                connect.map(|_| ()).unwrap_err().kind(),
                io::ErrorKind::ConnectionRefused,
                "{addr}: a received listener is still open"
            );
        }
    }

    #[test]
    fn inherited_listener_is_taken_only_when_it_is_one() {
        let listener = crate::base::net::bind_reuseport("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = listener.local_addr().unwrap();
        let dup = listener.as_fd().try_clone_to_owned().unwrap();
        let raw = std::os::fd::IntoRawFd::into_raw_fd(dup);
        let (owned, got) = take_inherited_listener(raw).unwrap();
        assert_eq!(got, addr);
        let flags = nix::fcntl::fcntl(owned.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
        assert!(flags & libc::FD_CLOEXEC != 0);
        // A descriptor that is not a listening socket stays open (it is not ours).
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(take_inherited_listener(a.as_raw_fd()).is_err());
        assert!(nix::fcntl::fcntl(a.as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).is_ok());
        assert!(take_inherited_listener(1).is_err());
    }

    #[test]
    fn non_listening_sockets_are_rejected() {
        let (a, _b) = UnixStream::pair().unwrap();
        assert!(listening_tcp_addr(a.as_fd()).is_err());
        let sock =
            socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        assert!(listening_tcp_addr(sock.as_fd()).is_err());
    }
}

#[cfg(test)]
mod filter_tests {
    use super::*;
    use std::os::fd::AsFd;
    use std::time::Duration;

    #[test]
    fn a_filtered_listener_takes_no_new_connection_and_refuses_none() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        // Before: a connect completes.
        drop(std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).unwrap());
        let (first, _) = listener.accept().unwrap();
        drop(first);
        drop_new_connections(listener.as_fd()).unwrap();
        // After: the SYN is dropped, neither accepted nor refused (the client would send it
        // again after 1 s).
        let e = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(300))
            .expect_err("connected through the filter");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        listener.set_nonblocking(true).unwrap();
        assert_eq!(
            listener.accept().unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
    }
}
