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
//! the program has counted every byte the socket received (`tcpi_bytes_received`) and every
//! byte counted in that direction has been written to the other (`tcpi_bytes_acked` +
//! `SIOCOUTQ`), so half-close does not overtake data still queued for redirection. Data that the
//! program passed to user space (a chunk read before the pair was complete) is copied on by the
//! proxy as usual.
//!
//! The program is 31 BPF instructions, written out below and loaded through
//! [`crate::sys::bpf`] (the typed `bpf(2)` calls, where the `unsafe` is); loading it needs
//! `CAP_BPF` and `CAP_NET_ADMIN` and a kernel with `CONFIG_BPF_STREAM_PARSER` (5.13 or newer
//! for the verdict-only attachment). Anything that fails while setting up makes the proxy
//! fall back to copying in user space ([`Sockmap::open`] errors at start, [`Sockmap::join`]
//! errors per connection); nothing is lost either way.

use std::io;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::time::{Duration, Instant};

use nix::sys::socket::{recv, MsgFlags};
use tokio::io::Interest;
use tokio::net::TcpStream;

use crate::sys::bpf::{
    self, annotate, Insn, Map, MapKind, Peer, BPF_ANY, BPF_F_NO_PREALLOC, BPF_NOEXIST,
};
use crate::sys::{
    cookie, set_rcvlowat, tcp_bytes_consumed, tcp_bytes_received, tcp_bytes_written, tcp_send_state,
};

/// Directions, as indices of the per-CPU totals.
pub const UP: u32 = 0;
pub const DOWN: u32 = 1;

/// The kernel objects: the program, attached to the socket map, and the maps.
pub struct Sockmap {
    /// Both sockets of every pair, by cookie.
    sockets: Map<u64, u32>,
    /// Each paired socket's [`Peer`] (the other socket, [`UP`] for the client's and [`DOWN`]
    /// for the backend's, bytes redirected), by cookie.
    peers: Map<u64, Peer>,
    /// Bytes redirected per direction, per CPU.
    totals: Map<u32, u64>,
    _program: std::os::fd::OwnedFd,
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

impl Sockmap {
    /// Creates the maps and loads and attaches the program; `pairs` connections at most are
    /// redirected at once (more are copied in user space).
    pub fn open(pairs: u32) -> io::Result<Sockmap> {
        let entries = pairs.saturating_mul(2).max(2);
        let sockets = Map::create(MapKind::Sockhash, entries, 0, "kap_sockets")?;
        let peers = Map::create(MapKind::Hash, entries, BPF_F_NO_PREALLOC, "kap_peers")?;
        let totals = Map::create(MapKind::PercpuArray, 2, 0, "kap_bytes")?;
        let insns = program(peers.raw_fd(), totals.raw_fd(), sockets.raw_fd());
        let program = bpf::load_sk_skb_verdict(&insns, "kap_verdict")?;
        bpf::attach_verdict(&sockets, &program)?;
        Ok(Sockmap {
            sockets,
            peers,
            totals,
            _program: program,
        })
    }

    /// Bytes redirected so far by the kernel, client to backend ([`UP`]) or back ([`DOWN`]).
    pub fn total(&self, direction: u32) -> u64 {
        match self.totals.lookup_percpu(&direction) {
            Ok(values) => values.iter().sum(),
            Err(_) => 0,
        }
    }

    /// Pairs `client` with `backend`: from now on the kernel moves their bytes. Dropping the
    /// pair takes them out again.
    pub fn join<'a>(&'a self, client: &TcpStream, backend: &TcpStream) -> io::Result<Pair<'a>> {
        let cookies = [cookie(client.as_fd())?, cookie(backend.as_fd())?];
        let mut pair = Pair {
            map: self,
            cookies,
            joined: 0,
            // What each destination had before the kernel wrote to it: up goes to the backend.
            base: [
                tcp_bytes_written(backend.as_fd())?,
                tcp_bytes_written(client.as_fd())?,
            ],
            consumed: [
                tcp_bytes_consumed(client.as_fd())?,
                tcp_bytes_consumed(backend.as_fd())?,
            ],
        };
        for (i, direction) in [UP, DOWN].into_iter().enumerate() {
            let peer = Peer::new(cookies[1 - i], direction);
            self.peers
                .update(&cookies[i], &peer, BPF_NOEXIST)
                .map_err(|e| annotate(e, "adding to the BPF peers map"))?;
            pair.joined += 1;
        }
        // Sockets in last: a chunk is only redirected once both are in (before that, the
        // program's redirect finds no socket and the chunk is dropped, so the order matters).
        for (fd, key) in [
            (backend.as_raw_fd(), &cookies[1]),
            (client.as_raw_fd(), &cookies[0]),
        ] {
            self.sockets
                .update(key, &(fd as u32), BPF_ANY)
                .map_err(|e| annotate(e, "adding to the BPF socket map"))?;
        }
        // Data that arrived before the socket was in the map waits in its receive queue until
        // the next arrival: let the program take it now.
        poke(backend);
        poke(client);
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
    /// Bytes taken from the client ([`UP`]) and the backend ([`DOWN`]) before the pairing:
    /// every byte either socket receives after it is the program's to count or the proxy's to
    /// copy.
    consumed: [u64; 2],
}

impl Pair<'_> {
    /// Bytes the kernel redirected from the client ([`UP`]) or the backend ([`DOWN`]).
    pub fn redirected(&self, direction: u32) -> u64 {
        match self.map.peers.lookup(&self.cookies[direction as usize]) {
            Ok(peer) => peer.bytes,
            Err(_) => 0,
        }
    }
}

impl Drop for Pair<'_> {
    fn drop(&mut self) {
        for key in &self.cookies[..self.joined] {
            self.map.peers.delete(key);
        }
        for key in &self.cookies {
            self.map.sockets.delete(key);
        }
    }
}

/// How often a direction lets the program take bytes it has not taken yet, 1 ms apart, before
/// it copies them itself.
const STALE_WAITS: u32 = 100;

/// Runs the socket's data-ready callback (the program's, once paired) over what waits in its
/// receive queue: setting `SO_RCVLOWAT` does that at once.
fn poke(socket: &TcpStream) {
    let _ = set_rcvlowat(socket.as_fd(), 1);
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

/// How long a half-close waits for bytes counted as redirected to reach the other socket
/// while none of them moves and that socket's send queue is empty (the kernel path holds
/// them, yet nothing stops it). A peer that reads slowly, or not at all for a while, keeps its
/// send queue full and is waited for as long as its connection is open (its keepalive and
/// `TCP_USER_TIMEOUT` end a dead one).
const FLUSH_LIMIT: Duration = Duration::from_secs(10);

/// Why [`carry`] failed when bytes counted as redirected did not reach the other socket (as
/// opposed to an error of the connection itself).
#[derive(Debug)]
struct Undelivered(String);

impl std::fmt::Display for Undelivered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Undelivered {}

impl Undelivered {
    fn error(kind: io::ErrorKind, message: String) -> io::Error {
        io::Error::new(kind, Undelivered(message))
    }
}

/// Whether [`carry`] failed with bytes it knows were not delivered.
pub fn undelivered(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| inner.is::<Undelivered>())
}

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
                poke(src);
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
    // EOF: wait until the program has counted every byte `src` received (the kernel takes a
    // chunk off the receive queue before the program counts it, so an empty queue and the EOF
    // can be seen first), then until what it redirected (and what was copied here) is in
    // `dst`; then pass the half-close on.
    // (`tcpi_bytes_received` counts the FIN as one byte, as it advances the sequence.)
    let arrived = tcp_bytes_received(src.as_fd())?
        .saturating_sub(pair.consumed[direction as usize])
        .saturating_sub(1);
    let mut moved = Instant::now();
    let (mut last, mut last_have) = (u64::MAX, 0);
    loop {
        let want = pair.redirected(direction) + copied;
        let sent = tcp_send_state(dst.as_fd())?;
        let have = sent.written.saturating_sub(base);
        if want >= arrived && have >= want && want == last {
            break;
        }
        if !sent.open {
            return Err(Undelivered::error(
                io::ErrorKind::ConnectionAborted,
                format!("the other side closed with redirected bytes not delivered: {have} of {want} written (direction {direction})"),
            ));
        }
        if have > last_have || want != last || sent.queued > 0 {
            // Moving, or waiting on the peer's reading.
            moved = Instant::now();
            last_have = have;
        }
        if moved.elapsed() > FLUSH_LIMIT {
            return Err(Undelivered::error(
                io::ErrorKind::TimedOut,
                format!("redirected bytes not flushed: {have} of {want} written, {arrived} arrived (direction {direction}, copied {copied})"),
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

    #[test]
    fn only_the_flush_failures_count_as_undelivered() {
        assert!(undelivered(&Undelivered::error(
            io::ErrorKind::TimedOut,
            "redirected bytes not flushed".into()
        )));
        // The same kinds from the connection itself (keepalive, the peer) are not.
        assert!(!undelivered(&io::Error::from(io::ErrorKind::TimedOut)));
        assert!(!undelivered(&io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "aborted"
        )));
    }

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
                assert!(!crate::in_ci(), "sockmap unavailable in CI: {e}");
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
