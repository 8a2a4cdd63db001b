//! Which addresses of this node serve a port, or are used to reach it: what `migrate` must not
//! silently leave behind.
//!
//! kubeadm's kube-apiserver listens on the wildcard address: every address of the node serves
//! port 6443, and clients use whichever they were given. `migrate` moves only its `--listen`
//! addresses to the proxy; every other one stops being served when kubeadm's apiserver stops. So
//! before it touches anything it looks for the addresses in use:
//!
//! - **established connections**: the local address of every connection to the port
//!   (`/proc/net/tcp{,6}`; IPv4-mapped addresses as IPv4), except the connections the apiserver
//!   makes to itself (its loopback client: both ends in that process);
//! - **kubeconfigs**: the `server:` of every `*.conf` in the Kubernetes directory (kubeadm's
//!   `admin.conf`, `super-admin.conf`, `kubelet.conf`, `controller-manager.conf`,
//!   `scheduler.conf`), when its port is the port and its host (an IP, or a name resolved here)
//!   is an address of this node;
//! - **`kube-public/cluster-info`**: the `server:` in that ConfigMap's kubeconfig (the
//!   `controlPlaneEndpoint` that joining nodes use), read through the API with `admin.conf`.
//!
//! An address is "of this node" when a socket can be bound to it (no `ip_nonlocal_bind`
//! consulted: a VIP that keepalived has moved away is not).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, ToSocketAddrs};
use std::path::Path;

/// One address found, and where.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Found {
    /// Why it counts: "3 established connections", "server of /etc/kubernetes/admin.conf", ….
    pub reasons: Vec<String>,
}

/// The addresses found (by IP; the port is the one asked about), and what could not be looked
/// at (a warning each).
#[derive(Debug, Default)]
pub struct Served {
    pub addresses: BTreeMap<IpAddr, Found>,
    pub warnings: Vec<String>,
}

impl Served {
    fn add(&mut self, ip: IpAddr, reason: String) {
        let ip = canonical(ip);
        let found = self.addresses.entry(ip).or_default();
        if !found.reasons.contains(&reason) {
            found.reasons.push(reason);
        }
    }
}

/// IPv4-mapped IPv6 addresses as IPv4.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// A TCP socket in `/proc/net/tcp{,6}`: local and remote address, state, inode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpEntry {
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub state: u8,
    pub inode: u64,
}

/// `ESTABLISHED` in the kernel's table.
pub const ESTABLISHED: u8 = 0x01;

/// Parses `HEX:PORT` of `/proc/net/tcp` (IPv4: one 32-bit word; IPv6: four, each in host
/// order).
fn parse_proc_addr(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    // The kernel prints each 32-bit word of the address (in network order in memory) as a
    // native integer: its native bytes are the address's bytes.
    let word = |s: &str| u32::from_str_radix(s, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(&ip[i * 8..i * 8 + 8])?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The entries of one `/proc/net/tcp{,6}` table.
pub fn parse_tcp_table(table: &str) -> Vec<TcpEntry> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 {
                return None;
            }
            Some(TcpEntry {
                local: parse_proc_addr(f[1])?,
                remote: parse_proc_addr(f[2])?,
                state: u8::from_str_radix(f[3], 16).ok()?,
                inode: f[9].parse().ok()?,
            })
        })
        .collect()
}

/// Both tables of this network namespace.
pub fn tcp_entries() -> Vec<TcpEntry> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .flat_map(|t| parse_tcp_table(&t))
        .collect()
}

/// The local addresses of established connections to `port`, with their count, leaving out
/// those whose client end is one of `own` (socket inodes of the serving process: the
/// apiserver's connections to itself). Pure.
pub fn established_to(entries: &[TcpEntry], port: u16, own: &[u64]) -> BTreeMap<IpAddr, usize> {
    let mut out = BTreeMap::new();
    for e in entries
        .iter()
        .filter(|e| e.state == ESTABLISHED && e.local.port() == port)
    {
        let client_is_own = entries.iter().any(|c| {
            c.state == ESTABLISHED
                && canonical(c.local.ip()) == canonical(e.remote.ip())
                && c.local.port() == e.remote.port()
                && canonical(c.remote.ip()) == canonical(e.local.ip())
                && c.remote.port() == port
                && own.contains(&c.inode)
        });
        if !client_is_own {
            *out.entry(canonical(e.local.ip())).or_insert(0) += 1;
        }
    }
    out
}

/// Whether `ip` is an address of this node: a socket can be bound to it.
pub fn is_local(ip: IpAddr) -> bool {
    let domain = socket2::Domain::for_address(SocketAddr::new(ip, 0));
    socket2::Socket::new(domain, socket2::Type::STREAM, None)
        .and_then(|s| s.bind(&SocketAddr::new(ip, 0).into()))
        .is_ok()
}

/// The servers of `text` (from `source`) on `port` that are addresses of this node.
fn add_servers(served: &mut Served, text: &str, source: &str, port: u16) {
    let servers = match crate::node::kubeconfig::servers(text) {
        Ok(servers) => servers,
        Err(e) => {
            served.warnings.push(format!("{source}: {e}"));
            return;
        }
    };
    for (host, p) in servers {
        if p != port {
            continue;
        }
        let ips: Vec<IpAddr> = match host.parse::<IpAddr>() {
            Ok(ip) => vec![ip],
            Err(_) => match (host.as_str(), port).to_socket_addrs() {
                Ok(addrs) => addrs.map(|a| a.ip()).collect(),
                Err(e) => {
                    served
                        .warnings
                        .push(format!("{source}: cannot resolve {host}: {e}"));
                    continue;
                }
            },
        };
        for ip in ips {
            if is_local(canonical(ip)) {
                served.add(ip, format!("server {host}:{port} in {source}"));
            }
        }
    }
}

/// Everything above, for `port`: `own` are the serving process's socket inodes, `dir` the
/// Kubernetes directory (`/etc/kubernetes`); `cluster_info` is the kubeconfig text of
/// `kube-public/cluster-info` if it could be read (or why not).
pub fn find(
    port: u16,
    own: &[u64],
    dir: &Path,
    cluster_info: Result<String, impl std::fmt::Display>,
) -> Served {
    let mut served = Served::default();
    for (ip, n) in established_to(&tcp_entries(), port, own) {
        served.add(
            ip,
            format!(
                "{n} established connection{}",
                if n == 1 { "" } else { "s" }
            ),
        );
    }
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            let mut confs: Vec<_> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "conf"))
                .collect();
            confs.sort();
            for conf in confs {
                match std::fs::read_to_string(&conf) {
                    Ok(text) => add_servers(&mut served, &text, &conf.display().to_string(), port),
                    Err(e) => served
                        .warnings
                        .push(format!("cannot read {}: {e}", conf.display())),
                }
            }
        }
        Err(e) => served
            .warnings
            .push(format!("cannot read {}: {e}", dir.display())),
    }
    match cluster_info {
        Ok(text) => add_servers(&mut served, &text, "kube-public/cluster-info", port),
        Err(e) => served
            .warnings
            .push(format!("cannot read kube-public/cluster-info: {e}")),
    }
    served
}

/// The socket inodes held by process `pid`.
pub fn socket_inodes(pid: u32) -> Vec<u64> {
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return Vec::new();
    };
    fds.filter_map(|e| {
        let target = std::fs::read_link(e.ok()?.path()).ok()?;
        target
            .to_str()?
            .strip_prefix("socket:[")?
            .strip_suffix(']')?
            .parse()
            .ok()
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_tables_parse_with_mapped_addresses() {
        // 192.0.2.10:6443 <- 192.0.2.20:40000 (v4), [::1]:6443 <- [::1]:50000, and a v4 client
        // on a dual-stack socket: ::ffff:127.0.0.1:6443 <- ::ffff:127.0.0.1:41000.
        let v4 = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0A0200C0:192B 140200C0:9C40 01 00000000:00000000 00:00000000 00000000     0        0 11 1 0\n";
        let e = parse_tcp_table(v4);
        assert_eq!(e[0].local, "192.0.2.10:6443".parse().unwrap());
        assert_eq!(e[0].remote, "192.0.2.20:40000".parse().unwrap());
        assert_eq!((e[0].state, e[0].inode), (ESTABLISHED, 11));
        let v6 = "  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000000000000000000001000000:192B 00000000000000000000000001000000:C350 01 00000000:00000000 00:00000000 00000000     0        0 21 1 0\n\
   1: 0000000000000000FFFF00000100007F:192B 0000000000000000FFFF00000100007F:A028 01 00000000:00000000 00:00000000 00000000     0        0 22 1 0\n";
        let e = parse_tcp_table(v6);
        assert_eq!(e[0].local, "[::1]:6443".parse().unwrap());
        assert_eq!(e[0].remote.port(), 50000);
        assert_eq!(
            canonical(e[1].local.ip()),
            "127.0.0.1".parse::<IpAddr>().unwrap()
        );
    }

    #[test]
    fn connections_the_server_makes_to_itself_do_not_count() {
        let entry = |l: &str, r: &str, inode| TcpEntry {
            local: l.parse().unwrap(),
            remote: r.parse().unwrap(),
            state: ESTABLISHED,
            inode,
        };
        let table = [
            // The apiserver's loopback client (inode 2) to itself on [::1].
            entry("[::1]:6443", "[::1]:50000", 1),
            entry("[::1]:50000", "[::1]:6443", 2),
            // The kubelet to the node address.
            entry("192.0.2.10:6443", "192.0.2.10:40000", 3),
            entry("192.0.2.10:40000", "192.0.2.10:6443", 4),
            // A client on another host to a VIP, twice.
            entry("192.0.2.100:6443", "198.51.100.7:1000", 5),
            entry("192.0.2.100:6443", "198.51.100.7:1001", 6),
            // The apiserver as a client of something else on 6443 elsewhere: not ours.
            entry("192.0.2.10:45000", "198.51.100.9:6443", 7),
        ];
        let found = established_to(&table, 6443, &[1, 2, 9]);
        let want: BTreeMap<IpAddr, usize> = [
            ("192.0.2.10".parse().unwrap(), 1),
            ("192.0.2.100".parse().unwrap(), 2),
        ]
        .into();
        assert_eq!(found, want);
        // Without knowing the server's sockets, [::1] counts.
        assert_eq!(established_to(&table, 6443, &[]).len(), 3);
    }

    #[test]
    fn servers_of_kubeconfigs() {
        let text = "clusters:\n- cluster:\n    server: https://192.0.2.100:6443\n- cluster:\n    server: \"https://[2001:db8::10]:6443/\"\n- cluster:\n    server: https://cp.example\n    other: 'server: x'\n";
        assert_eq!(
            crate::node::kubeconfig::servers(text).unwrap(),
            [
                ("192.0.2.100".to_owned(), 6443),
                ("2001:db8::10".to_owned(), 6443),
                ("cp.example".to_owned(), 443)
            ]
        );
        assert!(is_local("127.0.0.1".parse().unwrap()));
        // TEST-NET-3 is on no interface of a test machine.
        assert!(!is_local("203.0.113.77".parse().unwrap()));
    }
}
