//! One thread of the io_uring forwarder: a ring, one `SO_REUSEPORT` listening socket, a
//! multishot accept, and per connection a connect to the backend and then `recv`/`send` both
//! ways, everything submitted to the ring and nothing waited for in a system call of its own
//! (the loop's one `io_uring_enter` submits and waits).
//!
//! Buffers come from a provided-buffer ring (`IORING_REGISTER_PBUF_RING`) per thread, of
//! [`Pool::buffers`] buffers of [`Pool::size`] bytes (512 of 16 KiB by default): a `recv` takes one only when data arrives and
//! the buffer goes back to the ring when its bytes are sent, so an idle connection holds no
//! buffer. At most one `recv` or `send` is in flight per direction (the next `recv` is
//! submitted when the previous buffer has been sent), which keeps TCP's flow control end to
//! end. When the ring has no free buffer (`ENOBUFS`) the direction receives into a buffer of
//! its own, freed once its bytes are sent: waiting for a buffer of the ring could wait
//! forever, for each may be held by a send that waits for this very direction (an echo peer
//! that stops reading while its replies are not read). The pool is touched at start, so its
//! memory counts before any connection.
//!
//! Half-close: a `recv` of 0 bytes on one side is forwarded as `shutdown(SHUT_WR)` of the
//! other; a connection is closed when both directions have ended, or at once (both sockets
//! `shutdown(SHUT_RDWR)`, then closed when its last operation completes) after an error.
//!
//! `unsafe` is allowed in this module and nowhere else in the bench crate: an operation
//! handed to the ring carries raw pointers (a buffer to send, the backend's address) that the
//! kernel uses until the operation completes, which the compiler cannot check, and the
//! provided-buffer ring is memory shared with the kernel. Each `unsafe` block says why its
//! pointers stay valid.

#![allow(unsafe_code)]

use std::alloc::{alloc, dealloc, Layout};
use std::io;
use std::net::{Shutdown, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::atomic::{AtomicU16, Ordering};

use io_uring::types::{BufRingEntry, Fd};
use io_uring::{cqueue, opcode, squeue, IoUring};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// Submission queue entries per ring (the completion queue has twice as many).
const RING_ENTRIES: u32 = 4096;
/// The buffers of one thread's provided-buffer ring.
#[derive(Debug, Clone, Copy)]
pub struct Pool {
    /// How many: a power of two, at most 32768. Default 512.
    pub buffers: u16,
    /// Bytes each. Default 16 KiB, HAProxy's default `tune.bufsize`.
    pub size: u32,
}

impl Default for Pool {
    fn default() -> Self {
        Self {
            buffers: 512,
            size: 16 * 1024,
        }
    }
}
/// The buffer group id of the provided-buffer ring.
const GROUP: u16 = 0;

/// `user_data` of the multishot accept; the others are `slot << 8 | op`.
const ACCEPT: u64 = u64::MAX;
const OP_CONNECT: u64 = 0;
/// `recv`, `send` and `shutdown` are followed by the direction (0 or 1): 1 and 2, 3 and 4, 5
/// and 6.
const OP_RECV: u64 = 1;
const OP_SEND: u64 = 3;
const OP_SHUTDOWN: u64 = 5;

/// Client to backend, and backend to client.
const DIRECTIONS: [usize; 2] = [0, 1];

/// Whether io_uring can be used here: a ring with a provided-buffer ring of one buffer is set
/// up and dropped (`ENOSYS` without io_uring, `EPERM` where `kernel.io_uring_disabled` forbids
/// it, `EINVAL` before Linux 5.19).
pub fn probe() -> io::Result<()> {
    let ring = IoUring::new(8)?;
    let pool = Pool {
        buffers: 1,
        size: 4096,
    };
    let buffers = BufferRing::new(&ring, pool)?;
    drop(ring);
    drop(buffers);
    Ok(())
}

/// One thread's ring, listening socket and connections.
pub struct Worker {
    // Dropped first: the kernel stops using the buffer ring before its memory is freed.
    ring: IoUring,
    /// Set up with `IORING_SETUP_SINGLE_ISSUER` and `IORING_SETUP_DEFER_TASKRUN` (Linux 6.1).
    deferred: bool,
    buffers: BufferRing,
    listener: Socket,
    /// Boxed: connects in flight point at it.
    backend: Box<SockAddr>,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
}

/// A proxied connection.
struct Conn {
    client: Socket,
    backend: Socket,
    halves: [Half; 2],
    /// Operations submitted and not yet completed.
    inflight: u32,
    /// An error was seen: both sockets are shut down, the slot is freed when `inflight` is 0.
    failed: bool,
}

/// One direction of a connection.
#[derive(Default)]
struct Half {
    /// The buffer being sent.
    held: Option<Held>,
    /// A buffer of the direction's own, made when the ring had none (`ENOBUFS`) and freed when
    /// its bytes are sent.
    own: Option<Box<[u8]>>,
    /// End of stream seen and forwarded.
    done: bool,
}

/// Received bytes being sent.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// The ring's buffer, or `None` for the direction's own.
    bid: Option<u16>,
    /// Bytes received.
    len: usize,
    /// Bytes sent so far.
    sent: usize,
}

impl Conn {
    /// The socket a direction reads from.
    fn source(&self, dir: usize) -> RawFd {
        if dir == 0 {
            self.client.as_raw_fd()
        } else {
            self.backend.as_raw_fd()
        }
    }

    /// The socket a direction writes to.
    fn sink(&self, dir: usize) -> RawFd {
        self.source(1 - dir)
    }
}

impl Worker {
    /// Sets up the ring (single issuer, deferred task work where the kernel has them) and the
    /// provided-buffer ring for `listener`'s connections to `backend`.
    pub fn new(listener: Socket, backend: SocketAddr, pool: Pool) -> io::Result<Self> {
        let (ring, deferred) = match IoUring::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(RING_ENTRIES)
        {
            Ok(ring) => (ring, true),
            Err(_) => (IoUring::new(RING_ENTRIES)?, false),
        };
        let buffers = BufferRing::new(&ring, pool)?;
        Ok(Self {
            ring,
            deferred,
            buffers,
            listener,
            backend: Box::new(SockAddr::from(backend)),
            conns: Vec::new(),
            free: Vec::new(),
        })
    }

    /// Whether the ring defers task work to the single issuer (else it is a plain ring).
    pub fn deferred(&self) -> bool {
        self.deferred
    }

    /// Forwards connections until an error of the ring itself.
    pub fn run(mut self) -> io::Result<()> {
        self.arm_accept()?;
        let mut completions: Vec<(u64, i32, u32)> = Vec::with_capacity(2 * RING_ENTRIES as usize);
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(err) if matches!(err.raw_os_error(), Some(libc::EINTR | libc::EBUSY)) => {}
                Err(err) => return Err(err),
            }
            completions.clear();
            completions.extend(
                self.ring
                    .completion()
                    .map(|c| (c.user_data(), c.result(), c.flags())),
            );
            for &(data, result, flags) in &completions {
                self.complete(data, result, flags)?;
            }
        }
    }

    fn complete(&mut self, data: u64, result: i32, flags: u32) -> io::Result<()> {
        if data == ACCEPT {
            if result >= 0 {
                // SAFETY: the accept returned a new descriptor that nothing else owns.
                let client = unsafe { Socket::from_raw_fd(result) };
                self.open(client)?;
            }
            if !cqueue::more(flags) {
                self.arm_accept()?;
            }
            return Ok(());
        }
        let slot = (data >> 8) as usize;
        let op = data & 0xff;
        let conn = self.conns[slot]
            .as_mut()
            .expect("completion of a live slot");
        conn.inflight -= 1;
        match op {
            OP_CONNECT => {
                if result < 0 || conn.failed {
                    self.fail(slot);
                } else {
                    for dir in DIRECTIONS {
                        self.recv(slot, dir)?;
                    }
                }
            }
            op if op < OP_SEND => self.received(slot, (op - OP_RECV) as usize, result, flags)?,
            op if op < OP_SHUTDOWN => self.sent(slot, (op - OP_SEND) as usize, result)?,
            _ => {} // A `shutdown`, either direction: nothing left to do but maybe close.
        }
        self.maybe_close(slot);
        Ok(())
    }

    /// A new client: its backend socket and the connect. Without a descriptor for the backend
    /// socket the client is closed.
    fn open(&mut self, client: Socket) -> io::Result<()> {
        let domain = Domain::for_address(self.backend.as_socket().expect("an IP address"));
        let Ok(backend) = Socket::new(domain, Type::STREAM, Some(Protocol::TCP)) else {
            return Ok(());
        };
        let _ = client.set_nodelay(true);
        let _ = backend.set_nodelay(true);
        let fd = backend.as_raw_fd();
        let slot = self.insert(Conn {
            client,
            backend,
            halves: Default::default(),
            inflight: 1,
            failed: false,
        });
        let connect = opcode::Connect::new(Fd(fd), self.backend.as_ptr(), self.backend.len())
            .build()
            .user_data(user_data(slot, OP_CONNECT));
        self.push(&connect)
    }

    /// Submits a `recv` for `dir`: into a buffer of the ring, or into the direction's own
    /// buffer if it has one.
    fn recv(&mut self, slot: usize, dir: usize) -> io::Result<()> {
        let conn = self.conns[slot].as_mut().expect("live slot");
        conn.inflight += 1;
        let fd = Fd(conn.source(dir));
        let entry = match conn.halves[dir].own.as_mut() {
            Some(own) => opcode::Recv::new(fd, own.as_mut_ptr(), own.len() as u32).build(),
            None => opcode::Recv::new(fd, std::ptr::null_mut(), self.buffers.pool.size)
                .buf_group(GROUP)
                .build()
                .flags(squeue::Flags::BUFFER_SELECT),
        };
        self.push(&entry.user_data(user_data(slot, OP_RECV + dir as u64)))
    }

    /// Submits a `send` of what is left of the buffer `dir` holds.
    fn send(&mut self, slot: usize, dir: usize) -> io::Result<()> {
        let conn = self.conns[slot].as_mut().expect("live slot");
        let half = &conn.halves[dir];
        let held = half.held.expect("a held buffer");
        let start = match held.bid {
            Some(bid) => self.buffers.buffer(bid),
            None => half.own.as_ref().expect("an own buffer").as_ptr(),
        };
        let data = start.wrapping_add(held.sent);
        let entry = opcode::Send::new(Fd(conn.sink(dir)), data, (held.len - held.sent) as u32)
            .flags(libc::MSG_NOSIGNAL)
            .build()
            .user_data(user_data(slot, OP_SEND + dir as u64));
        conn.inflight += 1;
        self.push(&entry)
    }

    fn received(&mut self, slot: usize, dir: usize, result: i32, flags: u32) -> io::Result<()> {
        let bid = cqueue::buffer_select(flags);
        let conn = self.conns[slot].as_mut().expect("live slot");
        if conn.failed || result <= 0 {
            if let Some(bid) = bid {
                self.buffers.give_back(bid);
            }
        }
        if conn.failed {
            return Ok(());
        }
        match result {
            n if n == -libc::ENOBUFS => {
                // The ring is empty: every buffer is held by a send, and such a send may wait
                // for this very direction (an echo that stops reading while its replies are
                // not read). A buffer of its own, freed once sent, keeps it going.
                let size = self.buffers.pool.size as usize;
                conn.halves[dir].own = Some(vec![0; size].into_boxed_slice());
                self.recv(slot, dir)
            }
            n if n < 0 => {
                self.fail(slot);
                Ok(())
            }
            0 => {
                conn.halves[dir].done = true;
                conn.halves[dir].own = None;
                conn.inflight += 1;
                let entry = opcode::Shutdown::new(Fd(conn.sink(dir)), libc::SHUT_WR)
                    .build()
                    .user_data(user_data(slot, OP_SHUTDOWN + dir as u64));
                self.push(&entry)
            }
            n => {
                conn.halves[dir].held = Some(Held {
                    bid,
                    len: n as usize,
                    sent: 0,
                });
                self.send(slot, dir)
            }
        }
    }

    fn sent(&mut self, slot: usize, dir: usize, result: i32) -> io::Result<()> {
        let conn = self.conns[slot].as_mut().expect("live slot");
        let half = &mut conn.halves[dir];
        let mut held = half.held.take().expect("a send has its buffer");
        if !conn.failed && result >= 0 {
            held.sent += result as usize;
            if held.sent < held.len {
                half.held = Some(held);
                return self.send(slot, dir);
            }
        }
        // All sent, or given up: the buffer goes back to the ring, or is freed.
        match held.bid {
            Some(bid) => self.buffers.give_back(bid),
            None => half.own = None,
        }
        if result < 0 {
            self.fail(slot);
            Ok(())
        } else if conn.failed {
            Ok(())
        } else {
            self.recv(slot, dir)
        }
    }

    /// After an error: both sockets shut down, so that every operation in flight completes.
    fn fail(&mut self, slot: usize) {
        let Some(conn) = self.conns[slot].as_mut() else {
            return;
        };
        if !conn.failed {
            conn.failed = true;
            let _ = conn.client.shutdown(Shutdown::Both);
            let _ = conn.backend.shutdown(Shutdown::Both);
        }
    }

    /// Closes the connection if nothing is in flight and it is over.
    fn maybe_close(&mut self, slot: usize) {
        let Some(conn) = self.conns[slot].as_ref() else {
            return;
        };
        let over = conn.failed || conn.halves.iter().all(|h| h.done);
        if conn.inflight == 0 && over {
            self.conns[slot] = None;
            self.free.push(slot);
        }
    }

    fn insert(&mut self, conn: Conn) -> usize {
        match self.free.pop() {
            Some(slot) => {
                self.conns[slot] = Some(conn);
                slot
            }
            None => {
                self.conns.push(Some(conn));
                self.conns.len() - 1
            }
        }
    }

    fn arm_accept(&mut self) -> io::Result<()> {
        let entry = opcode::AcceptMulti::new(Fd(self.listener.as_raw_fd()))
            .flags(libc::SOCK_CLOEXEC)
            .build()
            .user_data(ACCEPT);
        self.push(&entry)
    }

    /// Queues `entry`, submitting what is queued first if the queue is full.
    fn push(&mut self, entry: &squeue::Entry) -> io::Result<()> {
        loop {
            // SAFETY: the pointers an entry carries stay valid until it completes: a send's
            // points into the buffer ring's memory, owned by `self` and held by the direction
            // until the send completes, or into the direction's own boxed buffer, freed only
            // after its send (or its `recv`, at the end of stream) has completed, and a `recv`
            // into that buffer likewise; a connect's at the boxed backend address, owned by
            // `self`; the descriptors are owned by a connection that is not dropped while it
            // has operations in flight.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                return Ok(());
            }
            self.ring.submit()?;
        }
    }
}

fn user_data(slot: usize, op: u64) -> u64 {
    (slot as u64) << 8 | op
}

/// A provided-buffer ring: one entry per buffer, shared with the kernel, and the buffers'
/// memory.
struct BufferRing {
    entries: *mut BufRingEntry,
    entries_layout: Layout,
    memory: *mut u8,
    memory_layout: Layout,
    tail: u16,
    pool: Pool,
}

impl BufferRing {
    /// Allocates the ring and the buffers, touches every page of them, hands every buffer to
    /// the kernel and registers the ring with `ring` as group [`GROUP`].
    fn new(ring: &IoUring, pool: Pool) -> io::Result<Self> {
        if !pool.buffers.is_power_of_two() || pool.buffers > 32768 || pool.size == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "buffers must be a power of two up to 32768, of a non-zero size",
            ));
        }
        let page = 4096;
        let entries_layout =
            Layout::from_size_align(usize::from(pool.buffers) * size_of::<BufRingEntry>(), page)
                .expect("valid layout");
        let memory_layout =
            Layout::from_size_align(usize::from(pool.buffers) * pool.size as usize, page)
                .expect("valid layout");
        // SAFETY: both layouts have a non-zero size.
        let (entries, memory) = unsafe { (alloc(entries_layout), alloc(memory_layout)) };
        if entries.is_null() || memory.is_null() {
            return Err(io::Error::from(io::ErrorKind::OutOfMemory));
        }
        // SAFETY: every offset written is inside its allocation; volatile, so that the pages
        // are really faulted in now (the pool's memory is a cost before any connection).
        unsafe {
            std::ptr::write_bytes(entries, 0, entries_layout.size());
            for offset in (0..memory_layout.size()).step_by(page) {
                memory.add(offset).write_volatile(0);
            }
        }
        let mut this = Self {
            entries: entries.cast(),
            entries_layout,
            memory,
            memory_layout,
            tail: 0,
            pool,
        };
        for bid in 0..pool.buffers {
            this.give_back(bid);
        }
        // SAFETY: the entries stay allocated until `self` is dropped, which the worker does
        // after the ring (its field order).
        unsafe {
            ring.submitter().register_buf_ring_with_flags(
                this.entries as u64,
                pool.buffers,
                GROUP,
                0,
            )?;
        }
        Ok(this)
    }

    /// The start of buffer `bid`.
    fn buffer(&self, bid: u16) -> *const u8 {
        // SAFETY: `bid` < the number of buffers, so the offset is inside the allocation.
        unsafe { self.memory.add(usize::from(bid) * self.pool.size as usize) }
    }

    /// Puts buffer `bid` at the ring's tail and publishes the tail to the kernel.
    fn give_back(&mut self, bid: u16) {
        let index = usize::from(self.tail & (self.pool.buffers - 1));
        // SAFETY: `index` < the number of entries; the kernel reads an entry only between its head and the
        // tail published below, and this entry is past the old tail.
        unsafe {
            let entry = &mut *self.entries.add(index);
            entry.set_addr(self.buffer(bid) as u64);
            entry.set_len(self.pool.size);
            entry.set_bid(bid);
        }
        self.tail = self.tail.wrapping_add(1);
        // SAFETY: the tail field is the `resv` of entry 0, a valid, aligned u16 that the
        // kernel reads concurrently: written atomically, with release ordering so that the
        // entry above is visible first.
        unsafe {
            let tail = BufRingEntry::tail(self.entries).cast::<AtomicU16>();
            (*tail).store(self.tail, Ordering::Release);
        }
    }
}

impl Drop for BufferRing {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with these layouts; the ring that used them is gone.
        unsafe {
            dealloc(self.entries.cast(), self.entries_layout);
            dealloc(self.memory, self.memory_layout);
        }
    }
}
