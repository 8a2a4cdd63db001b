//! `kube-apiserver-proxy migrate`: move the node address from kubeadm's static kube-apiserver
//! to the proxy without refusing a connection.
//!
//! kubeadm's kube-apiserver listens on the wildcard `0.0.0.0:6443` (`[::]:6443` with Go's dual
//! stack), as root and without `SO_REUSEPORT`. While that socket listens, nothing else can bind
//! port 6443 on any address: not the proxy on `NODE_IP:6443`, not `launch` on `127.a.b.c:6443`.
//! Closing it first refuses connections until something binds again.
//!
//! The kernel prefers the listener bound to a connection's exact destination address over a
//! wildcard one. So this command, as root:
//!
//! 1. finds the process holding the wildcard listener on the port (`/proc/net/tcp{,6}` and
//!    `/proc/*/fd`), duplicates that socket out of it (`pidfd_getfd`), sets `SO_REUSEPORT` on
//!    it and closes its duplicate again: the apiserver keeps serving on its socket, which from
//!    now on lets sockets of the same uid with `SO_REUSEPORT` bind beside it;
//! 2. creates one socket per `--listen` address (the proxy's, e.g. `NODE_IP:6443` and
//!    `127.0.0.1:6443`) under the wildcard socket's owner uid, with `SO_REUSEPORT`, and binds
//!    it, without listening yet (a bound socket receives nothing: the apiserver still gets
//!    every connection);
//! 3. drops to the proxy's uid and serves a handoff socket in `--handoff-dir` like a proxy
//!    instance: when the Deployment's proxy, healthy, asks its peers for sockets, this command
//!    starts listening on the asked ones and sends them. From then on every new connection to
//!    those addresses reaches the proxy; the apiserver's wildcard socket only sees connections
//!    to other addresses of the node, and it closes when the apiserver stops.
//!
//! Before step 1 changes anything, it looks for every address of the node that serves the port
//! or is used for it ([`crate::node::migration::served`]: established connections, the servers of kubeadm's
//! kubeconfigs and of `kube-public/cluster-info`): a VIP used as `controlPlaneEndpoint`, a second
//! NIC, the IPv6 side of a dual-stack node, `[::1]`. Each must be a `--listen` address or be
//! given to `--drop`; otherwise it refuses with one line naming them (exit 2), since those stop
//! being served when kubeadm's apiserver stops.
//!
//! It exits 0 once a proxy took the sockets, 1 when none asked before `--timeout` (nothing
//! listens then but the apiserver: nothing was changed but `SO_REUSEPORT` on its socket), 2 on
//! bad input or an address left behind (nothing bound). When the kernel denies the access to
//! the apiserver's descriptors, the error says what denies it: Yama's `ptrace_scope`, a missing
//! `CAP_SYS_PTRACE`, or a security module.

use std::collections::HashSet;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use nix::unistd::Uid;
use socket2::{Domain, Socket, Type};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::handoff::codec::{Message, PeerState};
use crate::handoff::server::{self, DirError, Peer, Reply, Responder};
use crate::node::object;
use crate::{node::migration::served, sys};

/// Why `migrate` failed. Its [`CommandError::is_bad_input`](crate::base::exit::CommandError::is_bad_input) tells exit code 2 from 1. The cause is
/// the source: print with `{:#}`.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// Bad input, or an address would be left behind: nothing was bound.
    #[error("migrate")]
    BadInput(#[from] InputError),
    /// It failed while moving the addresses.
    #[error("migrate")]
    Failed(#[from] Failure),
}

impl crate::base::exit::CommandError for MigrateError {
    /// Bad input: nothing was looked at or bound (exit code 2).
    fn is_bad_input(&self) -> bool {
        matches!(self, MigrateError::BadInput(_))
    }

    /// The error and its causes: its message does not repeat them.
    fn line(&self) -> String {
        crate::base::exit::chain(self)
    }
}

/// Flags `migrate` refuses before it looks at anything, and addresses it would leave behind.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    #[error("at least one --listen address is needed")]
    NoListen,
    #[error("--listen {0}: a wildcard address cannot be moved beside the apiserver's wildcard socket; give the node address and 127.0.0.1")]
    WildcardListen(SocketAddr),
    #[error("--listen {addr}: every address must use the same port ({port}), the port the apiserver's wildcard socket holds")]
    PortsDiffer { addr: SocketAddr, port: u16 },
    #[error("--listen {0}: port 0")]
    PortZero(SocketAddr),
    #[error("--listen {0} given twice")]
    Twice(SocketAddr),
    #[error("--uid 0: the sockets go to the proxy's uid (the Deployment's runAsUser, 59443)")]
    UidZero,
    #[error("must run as root: it reads the apiserver's socket with pidfd_getfd (CAP_SYS_PTRACE) and binds beside it under its uid")]
    NotRoot,
    #[error(transparent)]
    HandoffDir(#[from] DirError),
    /// Addresses in use that are neither moved nor dropped: `address (why it is in use)`.
    #[error("these addresses of this node serve port {port} now and would stop being served when kubeadm's apiserver stops: {}; give each as --listen (and in the Deployment's proxy --listen) or accept losing it with --drop", .uncovered.join(", "))]
    LeftBehind { port: u16, uncovered: Vec<String> },
}

/// What went wrong while moving the addresses.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The cause sits inside the sentence, so it is shown there rather than as a source.
    #[error("no wildcard listener on port {port}, and {addr} cannot be bound ({error}): something else holds it")]
    AddressHeld {
        port: u16,
        addr: SocketAddr,
        error: io::Error,
    },
    #[error(transparent)]
    NoHolder(#[from] NoHolder),
    #[error(transparent)]
    Getfd(#[from] GetfdError),
    #[error("SO_REUSEPORT on the apiserver's socket")]
    ReusePort(#[source] io::Error),
    #[error("the taken descriptor")]
    TakenAddr(#[source] io::Error),
    #[error("the taken descriptor")]
    TakenStat(#[source] nix::errno::Errno),
    #[error("the taken descriptor is {addr} (inode {found}), not the wildcard listener on port {port} (inode {inode})")]
    NotTheWildcard {
        addr: SocketAddr,
        found: u64,
        port: u16,
        inode: u64,
    },
    #[error("cannot bind {addr} beside the wildcard socket")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("the proxy's uid")]
    DropPrivileges(#[source] crate::instance::privileges::PrivilegeError),
    #[error("runtime")]
    Runtime(#[source] io::Error),
    #[error("--handoff-dir")]
    HandoffSocket(#[source] io::Error),
    #[error(transparent)]
    Signal(io::Error),
    #[error("no proxy asked for the sockets within {0:?}; nothing was handed over (the apiserver keeps serving)")]
    Timeout(Duration),
    #[error("interrupted; nothing was handed over")]
    Interrupted,
    #[error("terminated; nothing was handed over")]
    Terminated,
}

/// No process was found holding the wildcard listener.
#[derive(Debug, thiserror::Error)]
#[error("{}{}", self.what(), self.unread())]
pub struct NoHolder {
    /// `--pid`, when given.
    pid: Option<u32>,
    port: u16,
    inodes: Vec<u64>,
    /// The processes whose descriptors could not be read (the holder may be one of them).
    denied: Vec<(u32, io::Error)>,
    /// Why, when some could not be read.
    ptrace: Option<PtraceContext>,
}

impl NoHolder {
    fn what(&self) -> String {
        let port = self.port;
        match self.pid {
            Some(p) => format!("process {p} holds no wildcard listener on port {port}"),
            None => format!(
                "no process holds the wildcard listener on port {port} (inodes {:?})",
                self.inodes
            ),
        }
    }

    fn unread(&self) -> String {
        match (self.denied.first(), &self.ptrace) {
            (Some((p, e)), Some(ptrace)) => format!(
                "; the descriptors of {} process{} could not be read (/proc/{p}/fd: {e}): {}",
                self.denied.len(),
                if self.denied.len() == 1 { "" } else { "es" },
                ptrace.explain()
            ),
            _ => String::new(),
        }
    }
}

/// `pidfd_getfd` (or `pidfd_open`) failed on another process's descriptor; says what the
/// system says about it. The cause sits inside the sentence, before the explanation.
#[derive(Debug, thiserror::Error)]
#[error("pidfd_getfd of descriptor {fd} of process {pid}: {error}: {why}")]
pub struct GetfdError {
    pid: u32,
    fd: RawFd,
    error: io::Error,
    why: String,
}

impl GetfdError {
    pub(crate) fn new(error: io::Error, pid: u32, fd: RawFd) -> Self {
        let why = match error.raw_os_error() {
            Some(libc::ENOSYS) => "this kernel has no pidfd_getfd (Linux 5.6+ needed)".to_owned(),
            Some(libc::ESRCH) => format!("process {pid} exited"),
            Some(libc::EPERM | libc::EACCES) => PtraceContext::read().explain(),
            _ => "needs Linux 5.6+ and CAP_SYS_PTRACE".to_owned(),
        };
        GetfdError {
            pid,
            fd,
            error,
            why,
        }
    }
}

/// Why the `kube-public/cluster-info` kubeconfig could not be read.
#[derive(Debug, thiserror::Error)]
enum ClusterInfoError {
    #[error(transparent)]
    Client(#[from] crate::node::kubeconfig::KubeconfigError),
    #[error(transparent)]
    Api(#[from] crate::node::api::ApiError),
    #[error("no data.kubeconfig")]
    NoKubeconfig,
}

/// How `migrate` ended without error.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// A proxy took the sockets for these addresses.
    HandedOver(Vec<SocketAddr>),
    /// No wildcard listener holds the port and the addresses are free: the proxy can bind them
    /// itself.
    NothingToMigrate,
}

/// A listening socket found in `/proc/net/tcp{,6}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wildcard {
    pub inode: u64,
    pub v6: bool,
}

/// Listening sockets bound to the wildcard address (`0.0.0.0` or `::`) on `port`, as the
/// kernel lists them for this network namespace.
pub fn wildcard_listeners(port: u16) -> Vec<Wildcard> {
    let mut out = Vec::new();
    for (file, v6) in [("/proc/net/tcp", false), ("/proc/net/tcp6", true)] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        out.extend(
            parse_wildcard_listeners(&text, port)
                .into_iter()
                .map(|inode| Wildcard { inode, v6 }),
        );
    }
    out
}

/// The inodes of the wildcard listeners on `port` in one `/proc/net/tcp{,6}` table.
pub fn parse_wildcard_listeners(table: &str, port: u16) -> Vec<u64> {
    let mut out = Vec::new();
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode
        if f.len() < 10 || f[3] != "0A" {
            continue;
        }
        let Some((ip, p)) = f[1].split_once(':') else {
            continue;
        };
        let wildcard = !ip.is_empty() && ip.bytes().all(|b| b == b'0');
        if wildcard && u16::from_str_radix(p, 16).ok() == Some(port) {
            if let Ok(inode) = f[9].parse() {
                out.push(inode);
            }
        }
    }
    out
}

/// The first process (lowest pid, or `only`) with a descriptor on one of `inodes`: its pid,
/// the descriptor number and the inode; or, if none, the processes whose descriptors could not
/// be read (the holder may be one of them).
pub(crate) fn find_holder(
    inodes: &[u64],
    only: Option<u32>,
) -> Result<(u32, RawFd, u64), Vec<(u32, io::Error)>> {
    let mut pids: Vec<u32> = match only {
        Some(p) => vec![p],
        None => std::fs::read_dir("/proc")
            .map_err(|e| vec![(0, e)])?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect(),
    };
    pids.sort_unstable();
    let mut denied = Vec::new();
    for pid in pids {
        let fds = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
            Ok(fds) => fds,
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                denied.push((pid, e));
                continue;
            }
            Err(_) => continue,
        };
        let mut unreadable = None;
        for entry in fds.filter_map(|e| e.ok()) {
            let target = match std::fs::read_link(entry.path()) {
                Ok(t) => t,
                // Listing the directory needs only its mode; the links need ptrace access.
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                    unreadable.get_or_insert(e);
                    continue;
                }
                Err(_) => continue,
            };
            let Some(inode) = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            if inodes.contains(&inode) {
                if let Some(fd) = entry.file_name().to_str().and_then(|f| f.parse().ok()) {
                    return Ok((pid, fd, inode));
                }
            }
        }
        if let Some(e) = unreadable {
            denied.push((pid, e));
        }
    }
    Err(denied)
}

/// What the system says about a denied `ptrace` access (`pidfd_getfd`, reading
/// `/proc/PID/fd`): Yama's scope, our `CAP_SYS_PTRACE`, the active security modules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtraceContext {
    /// `/proc/sys/kernel/yama/ptrace_scope` (None: no Yama).
    pub yama_scope: Option<u8>,
    /// `CAP_SYS_PTRACE` in our effective set.
    pub cap_sys_ptrace: bool,
    /// `/sys/kernel/security/lsm` (None: not readable).
    pub lsms: Option<String>,
}

impl PtraceContext {
    /// Read from this system.
    pub fn read() -> Self {
        let yama_scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
            .ok()
            .and_then(|s| s.trim().parse().ok());
        // CapEff: a hex mask; CAP_SYS_PTRACE is capability 19.
        let cap_sys_ptrace = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("CapEff:"))
                    .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            })
            .is_some_and(|mask| mask & (1 << 19) != 0);
        let lsms = std::fs::read_to_string("/sys/kernel/security/lsm")
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty());
        PtraceContext {
            yama_scope,
            cap_sys_ptrace,
            lsms,
        }
    }

    /// Why an access to another process was denied (`EPERM`/`EACCES`). Pure.
    pub fn explain(&self) -> String {
        match (self.yama_scope, self.cap_sys_ptrace) {
            (Some(3), _) => "Yama's kernel.yama.ptrace_scope is 3: no process may attach to another, root with CAP_SYS_PTRACE included, and only a reboot lowers it; boot with a lower scope (1 or 2) for the migration, or move the node address with an outage".into(),
            (_, false) => format!(
                "this process lacks CAP_SYS_PTRACE{} (run it as root on the host, not in a container that drops it)",
                match self.yama_scope {
                    Some(2) => " (Yama's ptrace_scope is 2: only CAP_SYS_PTRACE may attach)",
                    _ => "",
                }
            ),
            (scope, true) => format!(
                "this process has CAP_SYS_PTRACE and Yama {} allows it, so a Linux security module forbids it (active: {}): look for a ptrace denial in the audit log (AppArmor: a profile confining the apiserver or this process; SELinux: the domain of either)",
                scope.map_or("(not active)".to_owned(), |s| format!("(ptrace_scope {s})")),
                self.lsms.as_deref().unwrap_or("unknown, /sys/kernel/security/lsm unreadable")
            ),
        }
    }
}

/// What `migrate` is asked for (its flags, `cli::MigrateArgs`).
#[derive(Debug, Clone)]
pub struct Options {
    /// An address the proxy serves (repeatable, the proxy's own --listen list: the node
    /// address and 127.0.0.1, same port as the apiserver's wildcard socket).
    pub listen: Vec<SocketAddr>,

    /// The proxies' handoff directory (owned by --uid, mode 0700).
    pub handoff_dir: PathBuf,

    /// The process holding the wildcard listener (default: found through /proc).
    pub pid: Option<u32>,

    /// The proxy's uid: this command drops to it before it serves the handoff socket (peers
    /// authenticate each other by uid).
    pub uid: u32,

    /// The proxy's gid (default: --uid).
    pub gid: Option<u32>,

    /// How long to wait for the Deployment's proxy to ask for the sockets.
    pub timeout: Duration,

    /// An address of this node that serves the port now and may stop being served (repeatable):
    /// before acting, migrate looks for every address in use (established connections,
    /// servers of the kubeconfigs in --kubernetes-dir and of kube-public/cluster-info) and
    /// refuses while one is neither a --listen address nor dropped here.
    pub drop: Vec<std::net::IpAddr>,

    /// kubeadm's directory: its *.conf kubeconfigs name the servers clients use; admin.conf
    /// reads kube-public/cluster-info.
    pub kubernetes_dir: PathBuf,
}

/// Checks the flags before anything is looked at or bound.
fn validate(args: &Options) -> Result<u16, InputError> {
    let Some(first) = args.listen.first() else {
        return Err(InputError::NoListen);
    };
    let port = first.port();
    let mut seen = HashSet::new();
    for addr in &args.listen {
        if addr.ip().is_unspecified() {
            return Err(InputError::WildcardListen(*addr));
        }
        if addr.port() != port {
            return Err(InputError::PortsDiffer { addr: *addr, port });
        }
        if port == 0 {
            return Err(InputError::PortZero(*addr));
        }
        if !seen.insert(*addr) {
            return Err(InputError::Twice(*addr));
        }
    }
    if args.uid == 0 {
        return Err(InputError::UidZero);
    }
    if !nix::unistd::geteuid().is_root() {
        return Err(InputError::NotRoot);
    }
    server::check_dir_of(&args.handoff_dir, args.uid)?;
    Ok(port)
}

/// A socket created under `owner`'s uid (the uid `SO_REUSEPORT` matches against), with
/// `SO_REUSEADDR` and `SO_REUSEPORT`, bound to `addr`, not listening.
fn bind_as(owner: u32, addr: SocketAddr) -> io::Result<Socket> {
    // The socket's uid is the creator's fsuid at socket() time; bind() checks it against the
    // wildcard socket's.
    let previous = nix::unistd::setfsuid(Uid::from_raw(owner));
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM.cloexec(), None);
    nix::unistd::setfsuid(previous);
    let socket = socket?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// One socket prepared for the proxy.
struct Prepared {
    addr: SocketAddr,
    socket: Socket,
    listening: bool,
}

/// Runs the whole migration (see the module documentation). Must be called before any other
/// thread exists: it changes the process's credentials.
pub fn run(args: &Options) -> Result<Outcome, MigrateError> {
    let port = validate(args)?;

    // 1. The apiserver's wildcard socket.
    let wildcards = wildcard_listeners(port);
    if wildcards.is_empty() {
        // Nothing to move: fine as long as the proxy can bind its addresses itself.
        for addr in &args.listen {
            crate::base::net::bind_reuseport(*addr).map_err(|error| Failure::AddressHeld {
                port,
                addr: *addr,
                error,
            })?;
        }
        tracing::info!(
            port,
            "migrate: no wildcard listener on the port; nothing to migrate (the proxy binds its addresses itself)"
        );
        return Ok(Outcome::NothingToMigrate);
    }
    let inodes: Vec<u64> = wildcards.iter().map(|w| w.inode).collect();
    let (pid, fd, inode) = find_holder(&inodes, args.pid)
        .map_err(|denied| NoHolder {
            pid: args.pid,
            port,
            inodes: inodes.clone(),
            ptrace: (!denied.is_empty()).then(PtraceContext::read),
            denied,
        })
        .map_err(Failure::from)?;

    // 2. Every address in use must be moved or dropped on purpose: the others stop being
    // served when kubeadm's apiserver stops.
    check_served(args, port, pid)?;

    let taken = sys::take_fd_of(pid, fd).map_err(|e| Failure::from(GetfdError::new(e, pid, fd)))?;
    let owner = check_taken(&taken, port, inode)?;
    socket2::SockRef::from(&taken)
        .set_reuse_port(true)
        .map_err(Failure::ReusePort)?;
    drop(taken);
    tracing::info!(
        pid,
        fd,
        inode,
        owner.uid = owner,
        "migrate: SO_REUSEPORT set on the wildcard listening socket (it stays with its process)"
    );

    // 3. Our sockets, bound beside it, not listening yet.
    let mut prepared = Vec::new();
    for addr in &args.listen {
        let socket = bind_as(owner, *addr).map_err(|source| Failure::Bind {
            addr: *addr,
            source,
        })?;
        prepared.push(Prepared {
            addr: *addr,
            socket,
            listening: false,
        });
    }
    tracing::info!(addrs = ?args.listen, "migrate: bound (not listening yet)");

    // 4. The proxy's uid from here on, and its handoff directory.
    crate::instance::privileges::switch(args.uid, args.gid.unwrap_or(args.uid), false)
        .map_err(Failure::DropPrivileges)?;
    let runtime = crate::base::runtime::current_thread().map_err(Failure::Runtime)?;
    runtime.block_on(serve(args, prepared))
}

/// Refuses (bad input: nothing was touched) while an address of this node that serves `port`
/// or is used for it is neither a `--listen` address nor given to `--drop`.
fn check_served(args: &Options, port: u16, pid: u32) -> Result<(), InputError> {
    let cluster_info = read_cluster_info(&args.kubernetes_dir);
    let found = served::find(
        port,
        &served::socket_inodes(pid),
        &args.kubernetes_dir,
        cluster_info,
    );
    for w in &found.warnings {
        tracing::warn!(warning = %w, "migrate: could not look everywhere for addresses in use");
    }
    let listen: Vec<IpAddr> = args
        .listen
        .iter()
        .map(|a| served::canonical(a.ip()))
        .collect();
    let mut uncovered = Vec::new();
    for (ip, f) in &found.addresses {
        let moved = listen.contains(ip);
        let dropped = args.drop.iter().any(|d| served::canonical(*d) == *ip);
        tracing::info!(address = %SocketAddr::new(*ip, port), reasons = %f.reasons.join("; "), moved, dropped, "migrate: address in use");
        if !moved && !dropped {
            uncovered.push(format!(
                "{} ({})",
                SocketAddr::new(*ip, port),
                f.reasons.join("; ")
            ));
        }
    }
    if uncovered.is_empty() {
        return Ok(());
    }
    Err(InputError::LeftBehind { port, uncovered })
}

/// The kubeconfig in `kube-public/cluster-info` (kubeadm's `controlPlaneEndpoint` as joining
/// nodes see it), read with `admin.conf`.
fn read_cluster_info(dir: &Path) -> Result<String, ClusterInfoError> {
    let api = crate::node::api::ApiClient::from_kubeconfig(&dir.join("admin.conf"))?;
    // Only read (a field this build does not know is ignored, not refused).
    let cm = crate::base::runtime::block_on(
        api.get_as::<ConfigMap>(&object::path::<ConfigMap>("kube-public", "cluster-info")),
    )?;
    cm.data
        .and_then(|mut data| data.remove("kubeconfig"))
        .ok_or(ClusterInfoError::NoKubeconfig)
}

/// The taken descriptor must be the wildcard listener found; returns its owner's uid.
fn check_taken(taken: &OwnedFd, port: u16, inode: u64) -> Result<u32, Failure> {
    let addr = sys::listening_tcp_addr(taken.as_fd()).map_err(Failure::TakenAddr)?;
    let stat = nix::sys::stat::fstat(taken.as_raw_fd()).map_err(Failure::TakenStat)?;
    if !addr.ip().is_unspecified() || addr.port() != port || stat.st_ino != inode {
        return Err(Failure::NotTheWildcard {
            addr,
            found: stat.st_ino,
            port,
            inode,
        });
    }
    Ok(stat.st_uid)
}

/// Serves the handoff socket until a proxy took the sockets or the timeout passed.
async fn serve(args: &Options, prepared: Vec<Prepared>) -> Result<Outcome, MigrateError> {
    let (listener, path) = server::bind(&args.handoff_dir).map_err(Failure::HandoffSocket)?;
    tracing::info!(socket = %path.display(), timeout = ?args.timeout, "migrate: waiting for a proxy to ask for the sockets");
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(Failure::Signal)?;
    let migrator = Arc::new(Migrator {
        uid: args.uid,
        prepared: tokio::sync::Mutex::new(prepared),
        given: Mutex::new(Vec::new()),
        done: CancellationToken::new(),
    });
    let stop = migrator.done.child_token();
    let tasks = TaskTracker::new();
    tasks.spawn(server::serve(
        migrator.clone(),
        listener,
        stop.clone(),
        tasks.clone(),
    ));
    let result = tokio::select! {
        _ = migrator.done.cancelled() => Ok(Outcome::HandedOver(
            migrator.given.lock().expect("given lock").clone(),
        )),
        _ = tokio::time::sleep_until(deadline) => Err(Failure::Timeout(args.timeout)),
        _ = tokio::signal::ctrl_c() => Err(Failure::Interrupted),
        _ = term.recv() => Err(Failure::Terminated),
    };
    stop.cancel();
    let _ = std::fs::remove_file(&path);
    Ok(result?)
}

/// The handoff server of `migrate`: a peer that is never ready (a draining instance must not
/// hand its sockets to it) and answers share requests only.
struct Migrator {
    /// The proxy's uid: the only peer allowed.
    uid: u32,
    prepared: tokio::sync::Mutex<Vec<Prepared>>,
    /// The addresses handed over, once `done`.
    given: Mutex<Vec<SocketAddr>>,
    /// Cancelled once a proxy took sockets.
    done: CancellationToken,
}

impl Responder for Migrator {
    const NAME: &'static str = "migrate";

    fn allows(&self, uid: u32) -> bool {
        uid == self.uid
    }

    fn status(&self) -> (PeerState, bool) {
        (PeerState::Migrating, false)
    }

    async fn share(&self, peer: &Peer, asked: &[String]) -> Reply {
        let mut prepared = self.prepared.lock().await;
        if let Some(given) = share(peer, &mut prepared, asked).await {
            *self.given.lock().expect("given lock") = given;
            self.done.cancel();
        }
        Reply::Answered
    }

    fn refuse(&self, pid: i32, request: &Message) -> Message {
        tracing::info!(peer.pid = pid, message = ?request, "migrate: refused (only share requests are answered)");
        Message::Refuse {
            reason: "migrating: only share requests are answered".into(),
        }
    }
}

/// Starts listening on the asked sockets and sends them. Returns the addresses handed over.
async fn share(
    peer: &Peer,
    prepared: &mut [Prepared],
    asked: &[String],
) -> Option<Vec<SocketAddr>> {
    let pid = peer.pid;
    for p in prepared.iter_mut() {
        if p.listening || !asked.iter().any(|a| *a == p.addr.to_string()) {
            continue;
        }
        match p.socket.listen(crate::base::net::LISTEN_BACKLOG) {
            Ok(()) => p.listening = true,
            Err(e) => tracing::warn!(listen.addr = %p.addr, error = %e, "migrate: cannot listen"),
        }
    }
    let give: Vec<&Prepared> = prepared
        .iter()
        .filter(|p| p.listening && asked.iter().any(|a| *a == p.addr.to_string()))
        .collect();
    let sockets: Vec<_> = give
        .iter()
        .map(|p| (p.addr.to_string(), p.socket.as_fd()))
        .collect();
    match peer.send_sockets(&sockets).await {
        Ok(()) if !give.is_empty() => {
            let given: Vec<SocketAddr> = give.iter().map(|p| p.addr).collect();
            let missing: Vec<SocketAddr> = prepared
                .iter()
                .filter(|p| !given.contains(&p.addr))
                .map(|p| p.addr)
                .collect();
            if !missing.is_empty() {
                tracing::warn!(peer.pid = pid, missing = ?missing, "migrate: the proxy did not ask for these addresses (not in its --listen); they are closed unused");
            }
            let identities: Vec<u64> = give
                .iter()
                .filter_map(|p| sys::identity(p.socket.as_fd()).ok().map(|i| i.cookie))
                .collect();
            tracing::info!(peer.pid = pid, addrs = ?given, cookies = ?identities, "migrate: listening sockets handed to the proxy");
            Some(given)
        }
        Ok(()) => {
            tracing::warn!(peer.pid = pid, asked = ?asked, "migrate: the proxy asked for none of our addresses");
            None
        }
        Err(e) => {
            tracing::warn!(peer.pid = pid, error = %e, "migrate: sending the sockets failed; waiting for another request");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wildcard_listeners_are_read_from_the_kernel_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000:192B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0000000000000000 100 0 0 10 0\n\
   1: 0A0200C0:192B 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2222 1 0000000000000000 100 0 0 10 0\n\
   2: 00000000:192B 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 3333 1 0000000000000000 100 0 0 10 0\n\
   3: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(parse_wildcard_listeners(table, 6443), vec![1111]);
        let v6 = "  sl  local_address remote_address st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000000000000000000000000000:192B 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 5555 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(parse_wildcard_listeners(v6, 6443), vec![5555]);
        assert!(parse_wildcard_listeners(v6, 6444).is_empty());
    }

    #[test]
    fn a_denied_ptrace_is_explained_by_what_denies_it() {
        let ctx = |yama_scope, cap_sys_ptrace, lsms: Option<&str>| PtraceContext {
            yama_scope,
            cap_sys_ptrace,
            lsms: lsms.map(str::to_owned),
        };
        let yama3 = ctx(Some(3), true, Some("capability,yama")).explain();
        assert!(
            yama3.contains("ptrace_scope is 3") && yama3.contains("reboot"),
            "{yama3}"
        );
        assert!(ctx(Some(3), false, None)
            .explain()
            .contains("ptrace_scope is 3"));
        let no_cap = ctx(Some(1), false, None).explain();
        assert!(no_cap.contains("lacks CAP_SYS_PTRACE"), "{no_cap}");
        assert!(ctx(Some(2), false, None)
            .explain()
            .contains("ptrace_scope is 2"));
        let lsm = ctx(Some(1), true, Some("lockdown,capability,yama,apparmor")).explain();
        assert!(
            lsm.contains("security module")
                && lsm.contains("apparmor")
                && lsm.contains("ptrace_scope 1"),
            "{lsm}"
        );
        assert!(ctx(None, true, None).explain().contains("(not active)"));
    }

    /// The error line main prints (`CommandError::line`: each layer, then its cause) reads as it
    /// always did, and the exit code follows the kind.
    #[test]
    fn errors_print_their_causes_on_one_line() {
        use crate::base::exit::CommandError as _;
        let line = |e: MigrateError| (e.is_bad_input(), e.line());
        let addr: SocketAddr = "127.0.0.1:6443".parse().unwrap();
        assert_eq!(
            line(InputError::Twice(addr).into()),
            (true, "migrate: --listen 127.0.0.1:6443 given twice".into())
        );
        let dir = server::check_dir_of(Path::new("/nonexistent/kap"), 1).unwrap_err();
        assert_eq!(
            line(InputError::from(dir).into()),
            (
                true,
                "migrate: --handoff-dir /nonexistent/kap: No such file or directory (os error 2)"
                    .into()
            )
        );
        let bind = Failure::Bind {
            addr,
            source: io::Error::from_raw_os_error(libc::EADDRINUSE),
        };
        assert_eq!(
            line(bind.into()),
            (
                false,
                "migrate: cannot bind 127.0.0.1:6443 beside the wildcard socket: Address already in use (os error 98)".into()
            )
        );
        let getfd = GetfdError::new(io::Error::from_raw_os_error(libc::ESRCH), 42, 7);
        assert_eq!(
            line(Failure::from(getfd).into()),
            (
                false,
                "migrate: pidfd_getfd of descriptor 7 of process 42: No such process (os error 3): process 42 exited".into()
            )
        );
        let none = NoHolder {
            pid: None,
            port: 6443,
            inodes: vec![11],
            denied: Vec::new(),
            ptrace: None,
        };
        assert_eq!(
            line(Failure::from(none).into()).1,
            "migrate: no process holds the wildcard listener on port 6443 (inodes [11])"
        );
    }

    #[test]
    fn a_live_wildcard_listener_is_found_with_its_process() {
        let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let found = wildcard_listeners(port);
        assert_eq!(found.len(), 1, "{found:?}");
        let (pid, fd, inode) = find_holder(&[found[0].inode], None).expect("holder");
        assert_eq!(pid, std::process::id());
        assert_eq!(fd, listener.as_raw_fd());
        assert_eq!(inode, found[0].inode);
        drop(listener);
        assert!(wildcard_listeners(port).is_empty());
    }
}
