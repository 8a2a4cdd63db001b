//! The node's policy routing for `run --client-address transparent`, and the
//! `transparent-routes` subcommand that installs it, spoken over rtnetlink (the image has no
//! `ip`); and the devices `migrate-back` makes and removes ([`add_link`], [`delete_link`]).
//!
//! A connection the proxy opens to a loopback backend with the client's address as its source
//! is answered by the backend from 127.a.b.c to that address. Routed as usual, the answer would
//! leave the node, which the kernel refuses for a loopback source, and the connection would
//! never complete. These rules and routes make such answers local, so they reach the proxy's
//! socket ([`items`]; `T` the table, `P` the priority):
//!
//! ```text
//! ip rule add from 127.0.0.0/24 iif lo lookup main priority P-1
//! ip rule add from 127.0.0.0/8 iif lo lookup T priority P
//! ip route add local 0.0.0.0/0 dev lo table T
//! ip -6 rule add from ::1/128 iif lo lookup T priority P
//! ip -6 route add local ::/0 dev lo table T
//! ```
//!
//! `iif lo` selects what this host sends, never what arrives from outside. The first rule keeps
//! 127.0.0.0/24 out of it: the host's own loopback traffic that is rewritten to another
//! destination (kube-proxy's NodePorts on localhost, Docker's published ports: DNAT from
//! 127.0.0.1) must go on being routed where its new destination is. Backends therefore live
//! outside 127.0.0.0/24, where `launch` puts them.
//!
//! The messages are written out here (a header and a few attributes each) rather than taken
//! from a netlink crate: `netlink-packet-route` was measured at +1.0 MB of static binary (+14 %)
//! and 37 s of release build for these five messages; neli brings a dozen more crates.

use std::fmt;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::socket::{
    bind, recv, send, setsockopt, socket, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag,
    SockProtocol, SockType,
};

/// The routing table the local routes go into (default of `--table`).
pub const DEFAULT_TABLE: u32 = 6443;
/// The priority of the rule that sends loopback sources to it (default of `--priority`); the
/// 127.0.0.0/24 exception takes the one before.
pub const DEFAULT_PRIORITY: u32 = 6443;

const RT_TABLE_MAIN: u32 = 254;

/// An address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

impl Family {
    fn code(self) -> u8 {
        match self {
            Family::V4 => libc::AF_INET as u8,
            Family::V6 => libc::AF_INET6 as u8,
        }
    }
}

/// One rule or route of the policy routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Item {
    /// `ip rule add from SRC/LEN iif lo lookup TABLE priority PRIORITY`.
    Rule {
        src: IpAddr,
        len: u8,
        table: u32,
        priority: u32,
    },
    /// `ip route add local 0.0.0.0/0 dev lo table TABLE` (`::/0` for IPv6).
    LocalRoute { family: Family, table: u32 },
}

impl Item {
    fn family(&self) -> Family {
        match self {
            Item::Rule {
                src: IpAddr::V4(_), ..
            } => Family::V4,
            Item::Rule { .. } => Family::V6,
            Item::LocalRoute { family, .. } => *family,
        }
    }
}

impl fmt::Display for Item {
    /// As `ip` would show it (and take it after `add` or `del`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ip = if self.family() == Family::V6 {
            "ip -6"
        } else {
            "ip"
        };
        match *self {
            Item::Rule {
                src,
                len,
                table,
                priority,
            } => {
                let table = if table == RT_TABLE_MAIN {
                    "main".to_string()
                } else {
                    table.to_string()
                };
                write!(
                    f,
                    "{ip} rule from {src}/{len} iif lo lookup {table} priority {priority}"
                )
            }
            Item::LocalRoute { family, table } => {
                let all = if family == Family::V6 {
                    "::/0"
                } else {
                    "0.0.0.0/0"
                };
                write!(f, "{ip} route local {all} dev lo table {table}")
            }
        }
    }
}

/// What the policy routing is, for `table` and `priority` (in the order they are added).
pub fn items(table: u32, priority: u32) -> Vec<Item> {
    vec![
        Item::Rule {
            src: Ipv4Addr::new(127, 0, 0, 0).into(),
            len: 24,
            table: RT_TABLE_MAIN,
            priority: priority.saturating_sub(1),
        },
        Item::Rule {
            src: Ipv4Addr::new(127, 0, 0, 0).into(),
            len: 8,
            table,
            priority,
        },
        Item::LocalRoute {
            family: Family::V4,
            table,
        },
        Item::Rule {
            src: Ipv6Addr::LOCALHOST.into(),
            len: 128,
            table,
            priority,
        },
        Item::LocalRoute {
            family: Family::V6,
            table,
        },
    ]
}

/// What happened to one item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Added,
    Present,
    Removed,
    Absent,
    /// Its address family is not available on this node (IPv6 turned off).
    NoFamily,
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Outcome::Added => "added",
            Outcome::Present => "present",
            Outcome::Removed => "removed",
            Outcome::Absent => "absent",
            Outcome::NoFamily => "skipped (address family not available)",
        })
    }
}

/// A netlink request that failed.
#[derive(Debug, thiserror::Error)]
#[error("{what}{hint}")]
pub struct RoutesError {
    what: String,
    hint: &'static str,
    #[source]
    source: io::Error,
}

impl crate::base::exit::CommandError for RoutesError {
    /// A rule or route the kernel would not read or add: a failure, not bad input.
    fn is_bad_input(&self) -> bool {
        false
    }

    /// The error and its causes.
    fn line(&self) -> String {
        crate::base::exit::chain(self)
    }
}

impl RoutesError {
    fn new(what: impl Into<String>, source: io::Error) -> Self {
        let hint = if source.raw_os_error() == Some(libc::EPERM) {
            " (needs CAP_NET_ADMIN)"
        } else {
            ""
        };
        RoutesError {
            what: what.into(),
            hint,
            source,
        }
    }
}

/// Adds every item that is not there yet.
pub fn install(items: &[Item]) -> Result<Vec<(Item, Outcome)>, RoutesError> {
    apply(items.iter(), true)
}

/// Removes every item that is there, in the reverse order of [`install`].
pub fn remove(items: &[Item]) -> Result<Vec<(Item, Outcome)>, RoutesError> {
    apply(items.iter().rev(), false)
}

/// Adds (`add`) each item that is absent, or removes each one that is present.
fn apply<'a>(
    items: impl Iterator<Item = &'a Item>,
    add: bool,
) -> Result<Vec<(Item, Outcome)>, RoutesError> {
    let mut nl = Netlink::open().map_err(|e| RoutesError::new("open a netlink socket", e))?;
    let lo = nix::net::if_::if_nametoindex("lo")
        .map_err(|e| RoutesError::new("find interface lo", e.into()))?;
    let mut done = Vec::new();
    for item in items {
        let outcome = match nl.present(item) {
            Err(e) if e.raw_os_error() == Some(libc::EAFNOSUPPORT) => Outcome::NoFamily,
            Err(e) => return Err(RoutesError::new(format!("list for {item}"), e)),
            Ok(present) if present == add => {
                if add {
                    Outcome::Present
                } else {
                    Outcome::Absent
                }
            }
            Ok(_) => {
                nl.change(item, lo, add)
                    .map_err(|e| RoutesError::new(format!("{item}"), e))?;
                if add {
                    Outcome::Added
                } else {
                    Outcome::Removed
                }
            }
        };
        done.push((*item, outcome));
    }
    Ok(done)
}

/// Whether this host delivers locally what a socket bound to `from` sends to `to`: the route
/// the kernel picks for such a packet is of type local (`ip route get TO from FROM`). True for
/// the backend's answers to a client once the policy routing is in place.
pub fn delivered_locally(from: IpAddr, to: IpAddr) -> io::Result<bool> {
    match Netlink::open()?.route_is_local(from, to) {
        // No route at all, or one that may not carry a loopback source: not local either.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EINVAL)
            ) =>
        {
            Ok(false)
        }
        other => other,
    }
}

// rtnetlink constants (linux/netlink.h, linux/rtnetlink.h, linux/fib_rules.h).
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_DUMP: u16 = 0x300;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
const RTM_GETROUTE: u16 = 26;
const RTM_NEWRULE: u16 = 32;
const RTM_DELRULE: u16 = 33;
const RTM_GETRULE: u16 = 34;
const RTA_DST: u16 = 1;
const RTA_SRC: u16 = 2;
const RTA_OIF: u16 = 4;
const RTA_TABLE: u16 = 15;
const FRA_SRC: u16 = 2;
const FRA_IIFNAME: u16 = 3;
const FRA_PRIORITY: u16 = 6;
const FRA_TABLE: u16 = 15;
const FR_ACT_TO_TBL: u8 = 1;
const RTN_LOCAL: u8 = 2;
const RT_SCOPE_HOST: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const HEADER_LEN: usize = 16;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
/// `struct ifinfomsg`: family, padding, type, index, flags, change; all zero here.
const IFINFOMSG: [u8; 16] = [0; 16];

/// A netlink message being built: the `nlmsghdr`, a 12-byte family header (`fib_rule_hdr` or
/// `rtmsg`, same size) and attributes.
struct Message(Vec<u8>);

impl Message {
    fn new(kind: u16, flags: u16, seq: u32, header: [u8; 12]) -> Self {
        Self::with_header(kind, flags, seq, &header)
    }

    /// A message whose family header is `header` (`ifinfomsg` is 16 bytes).
    fn with_header(kind: u16, flags: u16, seq: u32, header: &[u8]) -> Self {
        let mut b = Vec::with_capacity(64);
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(&kind.to_ne_bytes());
        b.extend_from_slice(&(flags | NLM_F_REQUEST).to_ne_bytes());
        b.extend_from_slice(&seq.to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        b.extend_from_slice(header);
        Message(b)
    }

    fn attr(mut self, kind: u16, data: &[u8]) -> Self {
        push_attr(&mut self.0, kind, data);
        self
    }

    fn finish(mut self) -> Vec<u8> {
        let len = self.0.len() as u32;
        self.0[..4].copy_from_slice(&len.to_ne_bytes());
        self.0
    }
}

/// Appends one attribute (length, type, data, padding to 4 bytes) to `b`; nested attributes
/// are attributes whose data is built this way.
fn push_attr(b: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = 4 + data.len();
    b.extend_from_slice(&(len as u16).to_ne_bytes());
    b.extend_from_slice(&kind.to_ne_bytes());
    b.extend_from_slice(data);
    b.resize(b.len().next_multiple_of(4), 0);
}

fn addr_bytes(ip: IpAddr) -> Vec<u8> {
    match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    }
}

/// The 12-byte header of a rule (`fib_rule_hdr`) or of a route (`rtmsg`): family, two prefix
/// lengths, tos, table, then three bytes (rule: two reserved and the action; route: protocol,
/// scope and type), then 32 bits of flags.
fn family_header(family: Family, lens: (u8, u8), table: u32, tail: [u8; 3]) -> [u8; 12] {
    let table = if table < 256 { table as u8 } else { 0 };
    [
        family.code(),
        lens.0,
        lens.1,
        0,
        table,
        tail[0],
        tail[1],
        tail[2],
        0,
        0,
        0,
        0,
    ]
}

/// Encodes the request that adds (`add`) or deletes `item`.
fn encode(item: &Item, lo: u32, add: bool, seq: u32) -> Vec<u8> {
    let flags = if add {
        NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL
    } else {
        NLM_F_ACK
    };
    match *item {
        Item::Rule {
            src,
            len,
            table,
            priority,
        } => {
            let kind = if add { RTM_NEWRULE } else { RTM_DELRULE };
            let header = family_header(item.family(), (0, len), table, [0, 0, FR_ACT_TO_TBL]);
            Message::new(kind, flags, seq, header)
                .attr(FRA_SRC, &addr_bytes(src))
                .attr(FRA_IIFNAME, b"lo\0")
                .attr(FRA_PRIORITY, &priority.to_ne_bytes())
                .attr(FRA_TABLE, &table.to_ne_bytes())
                .finish()
        }
        Item::LocalRoute { family, table } => {
            let kind = if add { RTM_NEWROUTE } else { RTM_DELROUTE };
            let header = family_header(
                family,
                (0, 0),
                table,
                [RTPROT_BOOT, RT_SCOPE_HOST, RTN_LOCAL],
            );
            Message::new(kind, flags, seq, header)
                .attr(RTA_TABLE, &table.to_ne_bytes())
                .attr(RTA_OIF, &lo.to_ne_bytes())
                .finish()
        }
    }
}

/// One message of a reply: its type, its family header and its attributes.
struct Reply<'a> {
    kind: u16,
    body: &'a [u8],
}

impl<'a> Reply<'a> {
    fn header(&self) -> Option<&'a [u8]> {
        self.body.get(..12)
    }

    /// The attributes after the 12-byte family header.
    fn attrs(&self) -> impl Iterator<Item = (u16, &'a [u8])> {
        let mut rest = self.body.get(12..).unwrap_or(&[]);
        std::iter::from_fn(move || {
            if rest.len() < 4 {
                return None;
            }
            let len = u16::from_ne_bytes([rest[0], rest[1]]) as usize;
            let kind = u16::from_ne_bytes([rest[2], rest[3]]) & 0x3fff;
            if len < 4 || len > rest.len() {
                return None;
            }
            let data = &rest[4..len];
            rest = rest.get(len.next_multiple_of(4)..).unwrap_or(&[]);
            Some((kind, data))
        })
    }

    fn attr(&self, kind: u16) -> Option<&'a [u8]> {
        self.attrs().find(|(k, _)| *k == kind).map(|(_, d)| d)
    }

    fn attr_u32(&self, kind: u16) -> Option<u32> {
        self.attr(kind)
            .and_then(|d| d.get(..4))
            .map(|d| u32::from_ne_bytes([d[0], d[1], d[2], d[3]]))
    }

    /// The table: the attribute if present, else the header's byte.
    fn table(&self) -> Option<u32> {
        self.attr_u32(RTA_TABLE)
            .or_else(|| self.header().map(|h| u32::from(h[4])))
    }
}

fn ip_from(data: &[u8]) -> Option<IpAddr> {
    match data.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(data).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(data).ok()?)),
        _ => None,
    }
}

/// Whether the dumped message `m` is `item`.
fn matches(item: &Item, m: &Reply<'_>) -> bool {
    let Some(h) = m.header() else {
        return false;
    };
    if h[0] != item.family().code() {
        return false;
    }
    match *item {
        Item::Rule {
            src,
            len,
            table,
            priority,
        } => {
            m.kind == RTM_NEWRULE
                && h[2] == len
                && h[1] == 0
                && h[7] == FR_ACT_TO_TBL
                && m.attr(FRA_SRC).and_then(ip_from) == Some(src)
                && m.attr(FRA_IIFNAME) == Some(b"lo\0".as_slice())
                && m.attr_u32(FRA_PRIORITY).unwrap_or(0) == priority
                && m.attr_u32(FRA_TABLE).unwrap_or(u32::from(h[4])) == table
        }
        Item::LocalRoute { table: t, .. } => {
            m.kind == RTM_NEWROUTE
                && h[1] == 0
                && h[7] == RTN_LOCAL
                && m.table() == Some(t)
                && m.attr(RTA_DST).is_none()
        }
    }
}

/// A route netlink socket.
struct Netlink {
    fd: OwnedFd,
    seq: u32,
    buf: Vec<u8>,
}

impl Netlink {
    fn open() -> io::Result<Self> {
        let fd = socket(
            AddressFamily::Netlink,
            SockType::Raw,
            SockFlag::SOCK_CLOEXEC,
            SockProtocol::NetlinkRoute,
        )?;
        bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
        // The kernel always answers; this only bounds a wait that should never happen.
        let timeout = nix::sys::time::TimeVal::from(libc::timeval {
            tv_sec: Duration::from_secs(10).as_secs() as _,
            tv_usec: 0,
        });
        setsockopt(&fd, sockopt::ReceiveTimeout, &timeout)?;
        Ok(Netlink {
            fd,
            seq: 0,
            buf: vec![0; 64 * 1024],
        })
    }

    /// Sends one request and calls `each` for every message of its answer, until the end of
    /// a dump, an acknowledgement or an error (returned as such).
    fn request(&mut self, msg: Vec<u8>, mut each: impl FnMut(&Reply<'_>)) -> io::Result<()> {
        let seq = u32::from_ne_bytes([msg[8], msg[9], msg[10], msg[11]]);
        send(self.fd.as_raw_fd(), &msg, MsgFlags::empty())?;
        loop {
            let n = recv(self.fd.as_raw_fd(), &mut self.buf, MsgFlags::empty())?;
            let mut rest = &self.buf[..n];
            while rest.len() >= HEADER_LEN {
                let len = u32::from_ne_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
                if len < HEADER_LEN || len > rest.len() {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "malformed netlink message",
                    ));
                }
                let kind = u16::from_ne_bytes([rest[4], rest[5]]);
                let got_seq = u32::from_ne_bytes([rest[8], rest[9], rest[10], rest[11]]);
                let body = &rest[HEADER_LEN..len];
                rest = rest.get(len.next_multiple_of(4)..).unwrap_or(&[]);
                if got_seq != seq {
                    continue;
                }
                match kind {
                    NLMSG_DONE => return Ok(()),
                    NLMSG_ERROR => {
                        let code = body
                            .get(..4)
                            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                            .unwrap_or(-libc::EIO);
                        return if code == 0 {
                            Ok(())
                        } else {
                            Err(io::Error::from_raw_os_error(-code))
                        };
                    }
                    _ => each(&Reply { kind, body }),
                }
            }
        }
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1);
        self.seq
    }

    /// Whether `item` is in the kernel's rules or routes.
    fn present(&mut self, item: &Item) -> io::Result<bool> {
        let seq = self.next_seq();
        let kind = match item {
            Item::Rule { .. } => RTM_GETRULE,
            Item::LocalRoute { .. } => RTM_GETROUTE,
        };
        let header = family_header(item.family(), (0, 0), 0, [0, 0, 0]);
        let msg = Message::new(kind, NLM_F_DUMP, seq, header).finish();
        let mut found = false;
        self.request(msg, |m| found |= matches(item, m))?;
        Ok(found)
    }

    fn change(&mut self, item: &Item, lo: u32, add: bool) -> io::Result<()> {
        let seq = self.next_seq();
        self.request(encode(item, lo, add, seq), |_| {})
    }

    fn route_is_local(&mut self, from: IpAddr, to: IpAddr) -> io::Result<bool> {
        let seq = self.next_seq();
        let (family, bits) = if to.is_ipv4() {
            (Family::V4, 32)
        } else {
            (Family::V6, 128)
        };
        let header = family_header(family, (bits, bits), 0, [0, 0, 0]);
        // With the acknowledgement the answer ends (a lookup answers one route, no end of dump).
        let msg = Message::new(RTM_GETROUTE, NLM_F_ACK, seq, header)
            .attr(RTA_DST, &addr_bytes(to))
            .attr(RTA_SRC, &addr_bytes(from))
            .finish();
        let mut local = false;
        self.request(msg, |m| {
            if m.kind == RTM_NEWROUTE {
                local = m.header().is_some_and(|h| h[7] == RTN_LOCAL);
            }
        })?;
        Ok(local)
    }
}

/// A network device [`add_link`] makes (down, no address: it carries no traffic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Link<'a> {
    /// `ip link add NAME type dummy` (needs the dummy module).
    Dummy,
    /// `ip link add NAME type veth peer name PEER`.
    Veth { peer: &'a str },
}

/// `ip link add name …`, over rtnetlink: fails (`EEXIST`) when a device of that name exists.
pub fn add_link(name: &str, link: Link<'_>) -> io::Result<()> {
    let mut nl = Netlink::open()?;
    let seq = nl.next_seq();
    let mut info = Vec::new();
    match link {
        Link::Dummy => push_attr(&mut info, IFLA_INFO_KIND, b"dummy"),
        Link::Veth { peer } => {
            push_attr(&mut info, IFLA_INFO_KIND, b"veth");
            let mut peer_msg = IFINFOMSG.to_vec();
            push_attr(&mut peer_msg, IFLA_IFNAME, &c_name(peer)?);
            let mut data = Vec::new();
            push_attr(&mut data, VETH_INFO_PEER, &peer_msg);
            push_attr(&mut info, IFLA_INFO_DATA, &data);
        }
    }
    let msg = Message::with_header(
        RTM_NEWLINK,
        NLM_F_ACK | NLM_F_CREATE | NLM_F_EXCL,
        seq,
        &IFINFOMSG,
    )
    .attr(IFLA_IFNAME, &c_name(name)?)
    .attr(IFLA_LINKINFO, &info)
    .finish();
    nl.request(msg, |_| {})
}

/// `ip link del NAME`, over rtnetlink (a veth pair goes with either end).
pub fn delete_link(name: &str) -> io::Result<()> {
    let mut nl = Netlink::open()?;
    let seq = nl.next_seq();
    let msg = Message::with_header(RTM_DELLINK, NLM_F_ACK, seq, &IFINFOMSG)
        .attr(IFLA_IFNAME, &c_name(name)?)
        .finish();
    nl.request(msg, |_| {})
}

/// A device name as the kernel takes it: at most 15 bytes and a NUL.
fn c_name(name: &str) -> io::Result<Vec<u8>> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['\0', '/']) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a device name"),
        ));
    }
    let mut b = name.as_bytes().to_vec();
    b.push(0);
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// As root, in a network namespace of a thread of its own: a veth pair made over rtnetlink
    /// is there (both ends), a second of the same name is refused, and deleting one end takes
    /// both away.
    #[test]
    fn a_veth_pair_is_made_and_deleted_over_rtnetlink() {
        if !nix::unistd::geteuid().is_root() {
            if std::env::var_os("CI").is_some() {
                panic!("a_veth_pair_is_made_and_deleted_over_rtnetlink needs root (CI is set)");
            }
            eprintln!("SKIP a_veth_pair_is_made_and_deleted_over_rtnetlink: needs root");
            return;
        }
        std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)
                .expect("unshare(CLONE_NEWNET)");
            let index = |n: &str| nix::net::if_::if_nametoindex(n).ok();
            add_link("kaptest0", Link::Veth { peer: "kaptest0p" }).expect("add veth");
            assert!(index("kaptest0").is_some() && index("kaptest0p").is_some());
            let again = add_link("kaptest0", Link::Veth { peer: "kaptest1p" }).unwrap_err();
            assert_eq!(again.raw_os_error(), Some(libc::EEXIST), "{again}");
            delete_link("kaptest0p").expect("delete veth");
            assert!(index("kaptest0").is_none() && index("kaptest0p").is_none());
            assert_eq!(
                delete_link("kaptest0").unwrap_err().raw_os_error(),
                Some(libc::ENODEV)
            );
            assert!(add_link("a/b", Link::Dummy).is_err());
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p));
    }

    #[test]
    fn items_read_as_ip_commands() {
        let shown: Vec<String> = items(6443, 6443).iter().map(|i| i.to_string()).collect();
        assert_eq!(
            shown,
            [
                "ip rule from 127.0.0.0/24 iif lo lookup main priority 6442",
                "ip rule from 127.0.0.0/8 iif lo lookup 6443 priority 6443",
                "ip route local 0.0.0.0/0 dev lo table 6443",
                "ip -6 rule from ::1/128 iif lo lookup 6443 priority 6443",
                "ip -6 route local ::/0 dev lo table 6443",
            ]
        );
    }

    /// The encoded rule is what `ip rule add from 127.0.0.0/8 iif lo lookup 6443 priority
    /// 6443` sends (header, then the attributes), and a dump entry of that rule is recognised.
    #[test]
    fn a_rule_round_trips_through_its_encoding() {
        let item = items(6443, 6443)[1];
        let msg = encode(&item, 1, true, 7);
        assert_eq!(msg.len() % 4, 0);
        assert_eq!(
            u32::from_ne_bytes(msg[..4].try_into().unwrap()) as usize,
            msg.len()
        );
        assert_eq!(u16::from_ne_bytes([msg[4], msg[5]]), RTM_NEWRULE);
        let body = &msg[HEADER_LEN..];
        // AF_INET, dst_len 0, src_len 8, tos 0, table 0 (in the attribute), action to-table.
        assert_eq!(&body[..8], &[2, 0, 8, 0, 0, 0, 0, FR_ACT_TO_TBL]);
        let dumped = Reply {
            kind: RTM_NEWRULE,
            body,
        };
        assert!(matches(&item, &dumped));
        assert_eq!(dumped.attr_u32(FRA_PRIORITY), Some(6443));
        // Another priority, another source length, another table: another rule.
        for other in [
            items(6443, 6000)[1],
            items(6443, 6443)[0],
            items(7000, 6443)[1],
        ] {
            assert!(!matches(&other, &dumped), "{other}");
        }
        let route = items(6443, 6443)[2];
        let msg = encode(&route, 1, true, 8);
        let dumped = Reply {
            kind: RTM_NEWROUTE,
            body: &msg[HEADER_LEN..],
        };
        assert!(matches(&route, &dumped));
        assert!(!matches(&items(6443, 6443)[4], &dumped));
    }
}
