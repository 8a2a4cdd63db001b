//! The kernel data path (`--data-path=sockmap`): once a client and its backend connection are
//! paired, the kernel moves their bytes from one socket to the other and the proxy's threads
//! are not woken for them.
//!
//! One BPF program of type `sk_skb` is attached (`BPF_SK_SKB_VERDICT`, no stream parser) to a
//! `SOCKHASH` that holds both sockets of every pair, keyed by socket cookie (`SO_COOKIE`). For
//! every chunk of data a socket of the map receives, the program looks the socket's cookie up
//! in the `peers` hash (the other socket's cookie, the direction, a byte count), adds the
//! chunk's length to the pair's count and to a per-CPU total per direction, and redirects the
//! chunk to the egress of the other socket (`bpf_sk_redirect_hash`). A socket that is not in
//! `peers` gets `SK_PASS`: its data stays readable by the proxy.
//!
//! User space keeps what the kernel path does not do (forward.rs, [`carry`]): it waits for
//! each socket's EOF or error, and on EOF shuts down the write half of the other socket once
//! every byte counted in that direction has been written to it (`tcpi_bytes_acked` +
//! `SIOCOUTQ`), so half-close does not overtake data still queued for redirection. Data that the
//! program passed to user space (a chunk read before the pair was complete) is copied on by the
//! proxy as usual.
//!
//! The program is eleven lines of BPF assembly, written out below as instructions; loading it
//! needs `CAP_BPF` and `CAP_NET_ADMIN` and a kernel with `CONFIG_BPF_STREAM_PARSER` (5.13 or
//! newer for the verdict-only attachment). Anything that fails while setting up makes the proxy
//! fall back to copying in user space ([`Sockmap::open`] errors at start, [`Sockmap::join`]
//! errors per connection); nothing is lost either way.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use nix::sys::socket::{recv, MsgFlags};
use tokio::io::Interest;
use tokio::net::TcpStream;

// bpf(2) commands, map and program types, attach type (include/uapi/linux/bpf.h).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_MAP_TYPE_HASH: u32 = 1;
const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
const BPF_MAP_TYPE_SOCKHASH: u32 = 18;
const BPF_PROG_TYPE_SK_SKB: u32 = 14;
const BPF_SK_SKB_VERDICT: u32 = 38;
const BPF_F_NO_PREALLOC: u32 = 1;
const BPF_ANY: u64 = 0;
const BPF_NOEXIST: u64 = 1;

/// Directions, as indices of the per-CPU totals.
pub const UP: u32 = 0;
pub const DOWN: u32 = 1;

/// The `peers` value of one socket: where its data goes and how much went.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Peer {
    /// The other socket's cookie (the key of its `SOCKHASH` entry).
    cookie: u64,
    /// [`UP`] for the client's socket, [`DOWN`] for the backend's.
    direction: u32,
    _pad: u32,
    /// Bytes redirected from this socket to the other, added to by the program.
    bytes: u64,
}

/// The kernel objects: the program, attached to the socket map, and the maps.
pub struct Sockmap {
    sockets: OwnedFd,
    peers: OwnedFd,
    totals: OwnedFd,
    _program: OwnedFd,
    cpus: usize,
}

/// A BPF instruction (`struct bpf_insn`).
#[derive(Clone, Copy)]
#[repr(C)]
struct Insn {
    code: u8,
    regs: u8,
    off: i16,
    imm: i32,
}

const fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
    Insn {
        code,
        regs: (src << 4) | dst,
        off,
        imm,
    }
}

// Opcodes used by the program.
const MOV64_REG: u8 = 0xbf;
const MOV64_IMM: u8 = 0xb7;
const ADD64_IMM: u8 = 0x07;
const LD_IMM64: u8 = 0x18;
const LDX_W: u8 = 0x61;
const LDX_DW: u8 = 0x79;
const STX_W: u8 = 0x63;
const STX_DW: u8 = 0x7b;
const ATOMIC_DW: u8 = 0xdb; // imm 0: atomic add
const JEQ_IMM: u8 = 0x15;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const PSEUDO_MAP_FD: u8 = 1;
// Helpers.
const MAP_LOOKUP_ELEM: i32 = 1;
const GET_SOCKET_COOKIE: i32 = 46;
const SK_REDIRECT_HASH: i32 = 72;
const SK_PASS: i32 = 1;

/// The verdict program, with the maps' descriptors filled in.
fn program(peers: RawFd, totals: RawFd, sockets: RawFd) -> Vec<Insn> {
    vec![
        // r6 = skb
        insn(MOV64_REG, 6, 1, 0, 0),
        // r0 = bpf_get_socket_cookie(skb); *(u64 *)(r10 - 8) = r0
        insn(CALL, 0, 0, 0, GET_SOCKET_COOKIE),
        insn(STX_DW, 10, 0, -8, 0),
        // r0 = bpf_map_lookup_elem(&peers, r10 - 8); if !r0 goto pass
        insn(LD_IMM64, 1, PSEUDO_MAP_FD, 0, peers),
        insn(0, 0, 0, 0, 0),
        insn(MOV64_REG, 2, 10, 0, 0),
        insn(ADD64_IMM, 2, 0, 0, -8),
        insn(CALL, 0, 0, 0, MAP_LOOKUP_ELEM),
        insn(JEQ_IMM, 0, 0, 22, 0),
        // r7 = peer; r8 = skb->len; peer->bytes += r8 (atomic)
        insn(MOV64_REG, 7, 0, 0, 0),
        insn(LDX_W, 8, 6, 0, 0),
        insn(ATOMIC_DW, 7, 8, 16, 0),
        // *(u32 *)(r10 - 12) = peer->direction; r0 = lookup(&totals, r10 - 12)
        insn(LDX_W, 1, 7, 8, 0),
        insn(STX_W, 10, 1, -12, 0),
        insn(LD_IMM64, 1, PSEUDO_MAP_FD, 0, totals),
        insn(0, 0, 0, 0, 0),
        insn(MOV64_REG, 2, 10, 0, 0),
        insn(ADD64_IMM, 2, 0, 0, -12),
        insn(CALL, 0, 0, 0, MAP_LOOKUP_ELEM),
        // if r0: *(u64 *)r0 += r8 (atomic: a softirq may interrupt a run in process context)
        insn(JEQ_IMM, 0, 0, 1, 0),
        insn(ATOMIC_DW, 0, 8, 0, 0),
        // *(u64 *)(r10 - 24) = peer->cookie; return bpf_sk_redirect_hash(skb, &sockets, r10 - 24, 0)
        insn(LDX_DW, 1, 7, 0, 0),
        insn(STX_DW, 10, 1, -24, 0),
        insn(MOV64_REG, 1, 6, 0, 0),
        insn(LD_IMM64, 2, PSEUDO_MAP_FD, 0, sockets),
        insn(0, 0, 0, 0, 0),
        insn(MOV64_REG, 3, 10, 0, 0),
        insn(ADD64_IMM, 3, 0, 0, -24),
        insn(MOV64_IMM, 4, 0, 0, 0),
        insn(CALL, 0, 0, 0, SK_REDIRECT_HASH),
        insn(EXIT, 0, 0, 0, 0),
        // pass: return SK_PASS
        insn(MOV64_IMM, 0, 0, 0, SK_PASS),
        insn(EXIT, 0, 0, 0, 0),
    ]
}

/// `union bpf_attr`, large enough for every command used here (the kernel checks that the
/// bytes it does not know are zero).
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 128])
    }
    fn u32(mut self, at: usize, v: u32) -> Attr {
        self.0[at..at + 4].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn u64(mut self, at: usize, v: u64) -> Attr {
        self.0[at..at + 8].copy_from_slice(&v.to_ne_bytes());
        self
    }
    fn name(mut self, at: usize, name: &str) -> Attr {
        let n = name.len().min(15);
        self.0[at..at + n].copy_from_slice(&name.as_bytes()[..n]);
        self
    }
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, writable `union bpf_attr` of the size given.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn bpf_fd(cmd: libc::c_long, attr: &mut Attr) -> io::Result<OwnedFd> {
    let fd = bpf(cmd, attr)?;
    // SAFETY: the commands used with this return a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

fn create_map(
    kind: u32,
    key: u32,
    value: u32,
    entries: u32,
    flags: u32,
    name: &str,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::new()
        .u32(0, kind)
        .u32(4, key)
        .u32(8, value)
        .u32(12, entries)
        .u32(16, flags)
        .name(28, name);
    bpf_fd(BPF_MAP_CREATE, &mut attr).map_err(|e| annotate(e, &format!("creating BPF map {name}")))
}

fn update(map: &OwnedFd, key: *const u8, value: *const u8, flags: u64) -> io::Result<()> {
    let mut attr = Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, key as u64)
        .u64(16, value as u64)
        .u64(24, flags);
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

fn lookup(map: &OwnedFd, key: *const u8, value: *mut u8) -> io::Result<()> {
    let mut attr = Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, key as u64)
        .u64(16, value as u64);
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).map(drop)
}

fn delete(map: &OwnedFd, key: *const u8) {
    let mut attr = Attr::new()
        .u32(0, map.as_raw_fd() as u32)
        .u64(8, key as u64);
    let _ = bpf(BPF_MAP_DELETE_ELEM, &mut attr);
}

fn annotate(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Number of possible CPUs (the per-CPU maps hold a value for each).
fn possible_cpus() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    let mut n = 0;
    for range in text.trim().split(',') {
        let mut ends = range.split('-').map(|s| s.trim().parse::<usize>());
        let bad = || {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "/sys/devices/system/cpu/possible",
            )
        };
        let lo = ends.next().ok_or_else(bad)?.map_err(|_| bad())?;
        let hi = match ends.next() {
            Some(hi) => hi.map_err(|_| bad())?,
            None => lo,
        };
        n += hi - lo + 1;
    }
    Ok(n.max(1))
}

/// A socket's cookie: the kernel's number for it, unique while the system runs.
fn cookie(fd: &impl AsFd) -> io::Result<u64> {
    let mut v: u64 = 0;
    let mut len = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `v` and `len` are valid for writing and describe an u64.
    let r = unsafe {
        libc::getsockopt(
            fd.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&mut v as *mut u64).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(v)
}

impl Sockmap {
    /// Creates the maps and loads and attaches the program; `pairs` connections at most are
    /// redirected at once (more are copied in user space).
    pub fn open(pairs: u32) -> io::Result<Sockmap> {
        let entries = pairs.saturating_mul(2).max(2);
        let sockets = create_map(BPF_MAP_TYPE_SOCKHASH, 8, 4, entries, 0, "kap_sockets")?;
        let peers = create_map(
            BPF_MAP_TYPE_HASH,
            8,
            std::mem::size_of::<Peer>() as u32,
            entries,
            BPF_F_NO_PREALLOC,
            "kap_peers",
        )?;
        let totals = create_map(BPF_MAP_TYPE_PERCPU_ARRAY, 4, 8, 2, 0, "kap_bytes")?;
        let insns = program(peers.as_raw_fd(), totals.as_raw_fd(), sockets.as_raw_fd());
        let license = c"GPL";
        let mut log = vec![0u8; 64 * 1024];
        let load = |log_level: u32, log: &mut Vec<u8>| {
            let mut attr = Attr::new()
                .u32(0, BPF_PROG_TYPE_SK_SKB)
                .u32(4, insns.len() as u32)
                .u64(8, insns.as_ptr() as u64)
                .u64(16, license.as_ptr() as u64)
                .u32(24, log_level)
                .u32(28, if log_level > 0 { log.len() as u32 } else { 0 })
                .u64(
                    32,
                    if log_level > 0 {
                        log.as_mut_ptr() as u64
                    } else {
                        0
                    },
                )
                .name(48, "kap_verdict")
                .u32(68, BPF_SK_SKB_VERDICT);
            bpf_fd(BPF_PROG_LOAD, &mut attr)
        };
        let program = match load(0, &mut log) {
            Ok(p) => p,
            Err(e)
                if e.raw_os_error() == Some(libc::EACCES)
                    || e.raw_os_error() == Some(libc::EINVAL) =>
            {
                // Load again with the verifier's log, to say why.
                let _ = load(1, &mut log);
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                let text = String::from_utf8_lossy(&log[..end]);
                let last = text
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("");
                return Err(annotate(
                    e,
                    &format!("loading the BPF verdict program ({last})"),
                ));
            }
            Err(e) => return Err(annotate(e, "loading the BPF verdict program")),
        };
        let mut attr = Attr::new()
            .u32(0, sockets.as_raw_fd() as u32)
            .u32(4, program.as_raw_fd() as u32)
            .u32(8, BPF_SK_SKB_VERDICT);
        bpf(BPF_PROG_ATTACH, &mut attr)
            .map_err(|e| annotate(e, "attaching the BPF verdict program"))?;
        Ok(Sockmap {
            sockets,
            peers,
            totals,
            _program: program,
            cpus: possible_cpus()?,
        })
    }

    /// Bytes redirected so far by the kernel, client to backend ([`UP`]) or back ([`DOWN`]).
    pub fn total(&self, direction: u32) -> u64 {
        let mut values = vec![0u64; self.cpus];
        let key = direction;
        match lookup(
            &self.totals,
            (&key as *const u32).cast(),
            values.as_mut_ptr().cast(),
        ) {
            Ok(()) => values.iter().sum(),
            Err(_) => 0,
        }
    }

    /// Pairs `client` with `backend`: from now on the kernel moves their bytes. Dropping the
    /// pair takes them out again.
    pub fn join<'a>(&'a self, client: &TcpStream, backend: &TcpStream) -> io::Result<Pair<'a>> {
        let cookies = [cookie(client)?, cookie(backend)?];
        let mut pair = Pair {
            map: self,
            cookies,
            joined: 0,
            // What each destination had before the kernel wrote to it: up goes to the backend.
            base: [written(backend)?, written(client)?],
        };
        for (i, direction) in [UP, DOWN].into_iter().enumerate() {
            let peer = Peer {
                cookie: cookies[1 - i],
                direction,
                ..Peer::default()
            };
            update(
                &self.peers,
                (&cookies[i] as *const u64).cast(),
                (&peer as *const Peer).cast(),
                BPF_NOEXIST,
            )
            .map_err(|e| annotate(e, "adding to the BPF peers map"))?;
            pair.joined += 1;
        }
        // Sockets in last: a chunk is only redirected once both are in (before that, the
        // program's redirect finds no socket and the chunk is dropped, so the order matters).
        for (fd, key) in [
            (backend.as_raw_fd(), &cookies[1]),
            (client.as_raw_fd(), &cookies[0]),
        ] {
            let value = fd as u32;
            update(
                &self.sockets,
                (key as *const u64).cast(),
                (&value as *const u32).cast(),
                BPF_ANY,
            )
            .map_err(|e| annotate(e, "adding to the BPF socket map"))?;
        }
        // Data that arrived before the socket was in the map waits in its receive queue until
        // the next arrival: let the program take it now.
        poke(backend.as_raw_fd());
        poke(client.as_raw_fd());
        Ok(pair)
    }
}

/// A client socket and its backend socket, paired in the kernel; taken out when dropped.
pub struct Pair<'a> {
    map: &'a Sockmap,
    cookies: [u64; 2],
    /// How many of the two `peers` entries were added.
    joined: usize,
    /// Bytes written into the backend ([`UP`]) and the client ([`DOWN`]) before the pairing.
    base: [u64; 2],
}

impl Pair<'_> {
    /// Bytes the kernel redirected from the client ([`UP`]) or the backend ([`DOWN`]).
    pub fn redirected(&self, direction: u32) -> u64 {
        let mut peer = Peer::default();
        let key = self.cookies[direction as usize];
        match lookup(
            &self.map.peers,
            (&key as *const u64).cast(),
            (&mut peer as *mut Peer).cast(),
        ) {
            Ok(()) => peer.bytes,
            Err(_) => 0,
        }
    }
}

impl Drop for Pair<'_> {
    fn drop(&mut self) {
        for key in &self.cookies[..self.joined] {
            delete(&self.map.peers, (key as *const u64).cast());
        }
        for key in &self.cookies {
            delete(&self.map.sockets, (key as *const u64).cast());
        }
    }
}

/// Bytes written into `socket` so far: acknowledged by the peer plus still in the send queue.
fn written(socket: &TcpStream) -> io::Result<u64> {
    let fd = socket.as_raw_fd();
    // SAFETY: `tcp_info` is plain integers, for which all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `info` and `len` describe a `tcp_info` buffer valid for writing.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut queued: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one int.
    if unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &mut queued) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(info.tcpi_bytes_acked + queued.max(0) as u64)
}

/// How often a direction lets the program take bytes it has not taken yet, 1 ms apart, before
/// it copies them itself.
const STALE_WAITS: u32 = 100;

/// Runs the socket's data-ready callback (the program's, once paired) over what waits in its
/// receive queue: setting `SO_RCVLOWAT` does that at once.
fn poke(fd: RawFd) {
    let one: libc::c_int = 1;
    // SAFETY: a valid int option of a socket we hold.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&one as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// Reads what is readable in `src` and writes all of it to `dst`; the count.
async fn copy_readable(src: &TcpStream, dst: &TcpStream) -> io::Result<u64> {
    let mut buf = vec![0u8; 16 * 1024];
    let n = match src.try_read(&mut buf) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut rest = &buf[..n];
    while !rest.is_empty() {
        dst.writable().await?;
        match dst.try_write(rest) {
            Ok(w) => rest = &rest[w..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n as u64)
}

/// How long a half-close waits for the bytes before it to be written out.
const FLUSH_LIMIT: Duration = Duration::from_secs(10);

/// Carries one paired connection: waits for EOF on each side and propagates it (once every
/// byte before it has been written to the other side), copies on whatever the program passed
/// to user space. Returns when both directions reached EOF or either failed.
pub async fn carry(
    pair: &Pair<'_>,
    client: &TcpStream,
    backend: &TcpStream,
    counters: (&crate::shard::Counter, &crate::shard::Counter),
) -> io::Result<()> {
    let up = one_way(pair, UP, client, backend, counters.0);
    let down = one_way(pair, DOWN, backend, client, counters.1);
    tokio::try_join!(up, down).map(drop)
}

async fn one_way(
    pair: &Pair<'_>,
    direction: u32,
    src: &TcpStream,
    dst: &TcpStream,
    counter: &crate::shard::Counter,
) -> io::Result<()> {
    let base = pair.base[direction as usize];
    let mut copied = 0u64;
    let mut waits = 0;
    loop {
        src.readable().await?;
        let mut probe = [0u8; 1];
        match src.try_io(Interest::READABLE, || {
            recv(
                src.as_raw_fd(),
                &mut probe,
                MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_PEEK,
            )
            .map_err(io::Error::from)
        }) {
            Ok(0) => break,
            Ok(_) if waits < STALE_WAITS => {
                // Bytes the program has not taken: they arrived before the pair was complete.
                // Let the program take them (in order with what follows) rather than copy them
                // here, where they could overtake bytes the kernel is already redirecting.
                waits += 1;
                poke(src.as_raw_fd());
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Ok(_) => {
                // Still there: copy them on in user space.
                let n = copy_readable(src, dst).await?;
                copied += n;
                counter.add(n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    // EOF: wait until what the kernel redirected (and what was copied here) is in `dst`, then
    // pass the half-close on.
    let start = Instant::now();
    let mut last = u64::MAX;
    loop {
        let want = pair.redirected(direction) + copied;
        let have = written(dst)?.saturating_sub(base);
        if have >= want && want == last {
            break;
        }
        if start.elapsed() > FLUSH_LIMIT {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("redirected bytes not flushed: {have} of {want} written (direction {direction}, copied {copied})"),
            ));
        }
        last = want;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    nix::sys::socket::shutdown(dst.as_raw_fd(), nix::sys::socket::Shutdown::Write)
        .map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shard::Counter;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn bytes_cross_intact_both_ways_with_half_close() {
        let map = match Sockmap::open(16) {
            Ok(m) => m,
            Err(e) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "sockmap unavailable in CI: {e}"
                );
                eprintln!("SKIPPED: sockmap unavailable: {e}");
                return;
            }
        };
        let front = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let back = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (front_addr, back_addr) = (front.local_addr().unwrap(), back.local_addr().unwrap());
        let up = pattern(3 << 20, 1);
        let down = pattern(5 << 20, 7);
        let (up2, down2) = (up.clone(), down.clone());
        // The client speaks first and waits for an answer (a TLS hello): its first bytes are
        // in the socket before the pair exists, and nothing else will follow until answered.
        let backend = tokio::spawn(async move {
            let (mut s, _) = back.accept().await.unwrap();
            let mut got = vec![0u8; 1000];
            s.read_exact(&mut got).await.unwrap();
            s.write_all(b"k").await.unwrap();
            s.read_to_end(&mut got).await.unwrap();
            assert!(
                got == up2,
                "backend got {} bytes, not the client's {}",
                got.len(),
                up2.len()
            );
            s.write_all(&down2).await.unwrap();
            s.shutdown().await.unwrap();
        });
        let client = tokio::spawn(async move {
            let mut s = TcpStream::connect(front_addr).await.unwrap();
            s.write_all(&up[..1000]).await.unwrap();
            let mut k = [0u8; 1];
            s.read_exact(&mut k).await.unwrap();
            s.write_all(&up[1000..]).await.unwrap();
            s.shutdown().await.unwrap();
            let mut got = Vec::new();
            s.read_to_end(&mut got).await.unwrap();
            assert!(
                got == down,
                "client got {} bytes, not the backend's {}",
                got.len(),
                down.len()
            );
        });
        let (c, _) = front.accept().await.unwrap();
        let b = TcpStream::connect(back_addr).await.unwrap();
        // The client's first bytes are there before the pair is made.
        c.readable().await.unwrap();
        let pair = map.join(&c, &b).unwrap();
        let counters = (Counter::default(), Counter::default());
        carry(&pair, &c, &b, (&counters.0, &counters.1))
            .await
            .unwrap();
        let (r_up, r_down) = (pair.redirected(UP), pair.redirected(DOWN));
        drop(pair);
        drop((c, b));
        client.await.unwrap();
        backend.await.unwrap();
        eprintln!(
            "redirected up {r_up} down {r_down}, copied up {} down {}",
            counters.0.get(),
            counters.1.get()
        );
        assert_eq!(r_up + counters.0.get(), 3 << 20);
        assert_eq!(r_down + counters.1.get(), (5 << 20) + 1);
        // Everything went through the kernel, also the bytes sent before the pair existed.
        assert_eq!((counters.0.get(), counters.1.get()), (0, 0));
        assert_eq!(map.total(UP) + counters.0.get(), 3 << 20);
    }
}
