//! `bpf(2)` for the kernel data path (`crate::sockmap`): maps, the verdict program's load and
//! its attachment, with raw `bpf(2)` calls (no second toolchain, no new crate).
//!
//! Why it is `unsafe`, and how that is kept here: every call passes the kernel a
//! `union bpf_attr` holding addresses that the kernel reads or writes. A map is typed by its
//! key and value ([`Map`]), created with exactly their sizes, and its calls take references to
//! them, so the kernel touches only memory that the call owns; keys and values are
//! [`Plain`] (integers only, no padding), so whatever the kernel writes is a valid value.

use std::io;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

// bpf(2) commands, map and program types, attach type (include/uapi/linux/bpf.h).
const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_PROG_TYPE_SK_SKB: u32 = 14;
const BPF_SK_SKB_VERDICT: u32 = 38;

/// Map flags and update flags.
pub const BPF_F_NO_PREALLOC: u32 = 1;
pub const BPF_ANY: u64 = 0;
pub const BPF_NOEXIST: u64 = 1;

/// The kinds of map the kernel data path uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MapKind {
    Hash = 1,
    /// One value per possible CPU: read with [`Map::lookup_percpu`].
    PercpuArray = 6,
    /// Sockets, keyed as chosen; the value written is the socket's descriptor.
    Sockhash = 18,
}

/// Keys and values the kernel copies in and out byte for byte.
///
/// # Safety
///
/// Only for types made of integers with no padding bytes (and `repr(C)` where a struct), so
/// that any bytes the kernel writes are a valid value and no uninitialised byte is read.
pub unsafe trait Plain: Copy + Default {}

// SAFETY: integers.
unsafe impl Plain for u32 {}
// SAFETY: integers.
unsafe impl Plain for u64 {}
// SAFETY: `repr(C)`, two u64 around two u32: integers, 24 bytes, no padding.
unsafe impl Plain for Peer {}

/// The value of the kernel data path's `peers` map, one per paired socket: where its data goes
/// and how much went. Its verdict program reads `cookie` at offset 0 and `direction` at 8, and
/// adds to `bytes` at 16.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct Peer {
    /// The other socket's cookie (the key of its `SOCKHASH` entry).
    pub cookie: u64,
    /// The direction, as the index of its per-CPU total.
    pub direction: u32,
    _pad: u32,
    /// Bytes redirected from this socket to the other, added to by the program.
    pub bytes: u64,
}

impl Peer {
    /// The entry of a socket whose data goes to the socket `cookie`, none gone yet.
    pub fn new(cookie: u64, direction: u32) -> Peer {
        Peer {
            cookie,
            direction,
            ..Peer::default()
        }
    }
}

/// A BPF instruction (`struct bpf_insn`).
#[derive(Clone, Copy)]
#[repr(C)]
pub struct Insn {
    pub code: u8,
    /// Destination register in the low nibble, source in the high one.
    pub regs: u8,
    pub off: i16,
    pub imm: i32,
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

/// Calls `bpf(cmd, attr)`.
///
/// # Safety
///
/// Every address in `attr` must be valid for what `cmd` does with it (reads or writes of the
/// sizes the map or the other fields of `attr` give) for the duration of the call.
unsafe fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, writable `union bpf_attr` of the size given; the addresses
    // inside it are the caller's to vouch for.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), attr.0.len()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// A command that returns a new descriptor.
///
/// # Safety
///
/// As [`bpf`].
unsafe fn bpf_fd(cmd: libc::c_long, attr: &mut Attr) -> io::Result<OwnedFd> {
    // SAFETY: passed on from the caller.
    let fd = unsafe { bpf(cmd, attr) }?;
    // SAFETY: the commands used with this return a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `e`, its message prefixed with what was being done.
pub fn annotate(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// A BPF map whose keys are `K` and values `V`.
pub struct Map<K, V> {
    fd: OwnedFd,
    /// For a per-CPU map, how many values one lookup writes (the possible CPUs).
    cpus: usize,
    _types: PhantomData<fn(K) -> V>,
}

impl<K: Plain, V: Plain> Map<K, V> {
    /// Creates a map of `kind` with room for `entries`.
    pub fn create(kind: MapKind, entries: u32, flags: u32, name: &str) -> io::Result<Self> {
        let cpus = if kind == MapKind::PercpuArray {
            // The kernel writes each CPU's value at a multiple of 8 bytes.
            if std::mem::size_of::<V>() % 8 != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "per-CPU values must be a multiple of 8 bytes",
                ));
            }
            possible_cpus()?
        } else {
            1
        };
        let mut attr = Attr::new()
            .u32(0, kind as u32)
            .u32(4, std::mem::size_of::<K>() as u32)
            .u32(8, std::mem::size_of::<V>() as u32)
            .u32(12, entries)
            .u32(16, flags)
            .name(28, name);
        // SAFETY: BPF_MAP_CREATE takes no addresses.
        let fd = unsafe { bpf_fd(BPF_MAP_CREATE, &mut attr) }
            .map_err(|e| annotate(e, &format!("creating BPF map {name}")))?;
        Ok(Map {
            fd,
            cpus,
            _types: PhantomData,
        })
    }

    /// The map's descriptor, for the instructions that refer to it.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Sets `key` to `value` (`BPF_ANY`, `BPF_NOEXIST`).
    pub fn update(&self, key: &K, value: &V, flags: u64) -> io::Result<()> {
        assert!(self.cpus == 1, "update of a per-CPU map");
        let mut attr = Attr::new()
            .u32(0, self.raw_fd() as u32)
            .u64(8, key as *const K as u64)
            .u64(16, value as *const V as u64)
            .u64(24, flags);
        // SAFETY: the kernel reads the map's key and value sizes, `K`'s and `V`'s, from these
        // references (a per-CPU map, whose value is one per CPU, is refused above).
        unsafe { bpf(BPF_MAP_UPDATE_ELEM, &mut attr) }.map(drop)
    }

    /// The value of `key`.
    pub fn lookup(&self, key: &K) -> io::Result<V> {
        assert!(self.cpus == 1, "lookup of one value in a per-CPU map");
        let mut value = V::default();
        let mut attr = Attr::new()
            .u32(0, self.raw_fd() as u32)
            .u64(8, key as *const K as u64)
            .u64(16, &mut value as *mut V as u64);
        // SAFETY: the kernel reads `K`'s size from `key` and writes `V`'s size into `value`.
        unsafe { bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) }?;
        Ok(value)
    }

    /// Every CPU's value of `key` in a per-CPU map.
    pub fn lookup_percpu(&self, key: &K) -> io::Result<Vec<V>> {
        let mut values = vec![V::default(); self.cpus];
        let mut attr = Attr::new()
            .u32(0, self.raw_fd() as u32)
            .u64(8, key as *const K as u64)
            .u64(16, values.as_mut_ptr() as u64);
        // SAFETY: the kernel writes one value of `V`'s size (a multiple of 8, checked at
        // creation) per possible CPU: `values` has room for that many.
        unsafe { bpf(BPF_MAP_LOOKUP_ELEM, &mut attr) }?;
        Ok(values)
    }

    /// Removes `key`; a key that is not there is no error.
    pub fn delete(&self, key: &K) {
        let mut attr = Attr::new()
            .u32(0, self.raw_fd() as u32)
            .u64(8, key as *const K as u64);
        // SAFETY: the kernel reads `K`'s size from `key`.
        let _ = unsafe { bpf(BPF_MAP_DELETE_ELEM, &mut attr) };
    }
}

/// Loads `insns` as an `sk_skb` stream-verdict program named `name` (GPL, the helpers it
/// calls need it). When the verifier refuses it, loads it again with the verifier's log and
/// says its last line.
pub fn load_sk_skb_verdict(insns: &[Insn], name: &str) -> io::Result<OwnedFd> {
    let license = c"GPL";
    let load = |log: Option<&mut [u8]>| {
        let (level, len, addr) = match log {
            Some(buf) => (1, buf.len() as u32, buf.as_mut_ptr() as u64),
            None => (0, 0, 0),
        };
        let mut attr = Attr::new()
            .u32(0, BPF_PROG_TYPE_SK_SKB)
            .u32(4, insns.len() as u32)
            .u64(8, insns.as_ptr() as u64)
            .u64(16, license.as_ptr() as u64)
            .u32(24, level)
            .u32(28, len)
            .u64(32, addr)
            .name(48, name)
            .u32(68, BPF_SK_SKB_VERDICT);
        // SAFETY: the kernel reads `insns.len()` instructions from `insns`, the license up to
        // its NUL, and writes at most `len` bytes of log into the buffer of that length.
        unsafe { bpf_fd(BPF_PROG_LOAD, &mut attr) }
    };
    match load(None) {
        Ok(p) => Ok(p),
        Err(e)
            if e.raw_os_error() == Some(libc::EACCES) || e.raw_os_error() == Some(libc::EINVAL) =>
        {
            let mut log = vec![0u8; 64 * 1024];
            let _ = load(Some(&mut log));
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let last = text
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            Err(annotate(
                e,
                &format!("loading the BPF verdict program ({last})"),
            ))
        }
        Err(e) => Err(annotate(e, "loading the BPF verdict program")),
    }
}

/// Attaches a stream-verdict `program` to the socket map `map`.
pub fn attach_verdict<K, V>(map: &Map<K, V>, program: &OwnedFd) -> io::Result<()> {
    let mut attr = Attr::new()
        .u32(0, map.fd.as_raw_fd() as u32)
        .u32(4, program.as_raw_fd() as u32)
        .u32(8, BPF_SK_SKB_VERDICT);
    // SAFETY: BPF_PROG_ATTACH takes no addresses.
    unsafe { bpf(BPF_PROG_ATTACH, &mut attr) }
        .map(drop)
        .map_err(|e| annotate(e, "attaching the BPF verdict program"))
}

/// Number of possible CPUs (the per-CPU maps hold a value for each).
fn possible_cpus() -> io::Result<usize> {
    let text = std::fs::read_to_string("/sys/devices/system/cpu/possible")?;
    parse_cpu_list(&text).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("/sys/devices/system/cpu/possible: cannot read {text:?}"),
        )
    })
}

/// How many CPUs a list such as `0-3,8,10-11` names.
fn parse_cpu_list(text: &str) -> Option<usize> {
    let mut n = 0;
    for range in text.trim().split(',') {
        let (lo, hi) = match range.split_once('-') {
            Some((lo, hi)) => (lo.trim().parse::<usize>().ok()?, hi.trim().parse().ok()?),
            None => {
                let one = range.trim().parse::<usize>().ok()?;
                (one, one)
            }
        };
        n += hi.checked_sub(lo)? + 1;
    }
    Some(n.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A map's calls move exactly its key and value: what is written is read back, per CPU too.
    #[test]
    fn typed_maps_round_trip() {
        let map = match Map::<u64, u64>::create(MapKind::Hash, 4, BPF_F_NO_PREALLOC, "kap_test") {
            Ok(m) => m,
            Err(e) => {
                assert!(!crate::in_ci(), "bpf maps unavailable in CI: {e}");
                eprintln!("SKIPPED: bpf maps unavailable: {e}");
                return;
            }
        };
        map.update(&7, &u64::MAX, BPF_NOEXIST).unwrap();
        assert_eq!(map.lookup(&7).unwrap(), u64::MAX);
        let again = map.update(&7, &1, BPF_NOEXIST).unwrap_err();
        assert_eq!(again.raw_os_error(), Some(libc::EEXIST), "{again}");
        map.delete(&7);
        let gone = map.lookup(&7).unwrap_err();
        assert_eq!(gone.raw_os_error(), Some(libc::ENOENT), "{gone}");
        let percpu = Map::<u32, u64>::create(MapKind::PercpuArray, 2, 0, "kap_test_cpu").unwrap();
        let values = percpu.lookup_percpu(&1).unwrap();
        assert_eq!(values, vec![0; possible_cpus().unwrap()]);
    }

    /// A per-CPU value the kernel would write at other offsets than `Vec<V>` has is refused
    /// before any call.
    #[test]
    fn per_cpu_values_must_be_whole_words() {
        let e = Map::<u32, u32>::create(MapKind::PercpuArray, 2, 0, "kap_test_bad")
            .err()
            .expect("a per-CPU map of u32 values");
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
    }

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-1\n"), Some(2));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-3,8,10-11"), Some(7));
        assert_eq!(parse_cpu_list("3-1"), None);
        assert_eq!(parse_cpu_list("x"), None);
    }
}
