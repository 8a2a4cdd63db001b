//! `kube-apiserver-proxy migrate-back`: from the Deployment back to kubeadm's static
//! kube-apiserver without refusing a connection — `migrate`'s socket dance in reverse.
//!
//! kubeadm's apiserver binds the wildcard `0.0.0.0:6443`; while any other socket listens on port
//! 6443 (the proxies on `NODE_IP:6443` and `127.0.0.1:6443`, the Deployment's apiserver on
//! `127.a.b.c:6443`) that bind fails, unless every one of them and the new one share the port
//! with `SO_REUSEPORT` under one uid. So this command, as root, with kubeadm's manifest rendered
//! for the version that runs now and with `--permit-port-sharing=true` (kube-apiserver's own
//! flag for `SO_REUSEPORT`; docs/runbooks/going-back.md says how kubeadm renders it):
//!
//! 1. checks that the manifest's image is the version the apiserver serving now reports
//!    (`/version`): the way back is kubeadm's manifest of today, never an older saved copy;
//! 2. takes a duplicate of every socket listening on the port (`pidfd_getfd`), sets
//!    `SO_REUSEPORT` on it and gives it to root (`fchown` of a socket changes the uid the
//!    kernel matches), and closes the duplicate: the proxies and the apiserver keep serving;
//! 3. puts the manifest into the kubelet's static pod directory; kubeadm's apiserver starts and
//!    binds `0.0.0.0:6443` beside them. The kernel prefers a connection's exact address, so the
//!    proxies keep getting every connection to theirs; the static apiserver gets the rest;
//! 4. serves a handoff socket in `--handoff-dir` like a proxy instance (as the proxies' uid),
//!    ready once the static apiserver answers `/readyz`. When the Deployment is deleted, its
//!    proxy, draining, offers its listening sockets to this ready peer. They are taken and bound
//!    to a network device that carries no traffic (`SO_BINDTODEVICE`; a dummy, else a veth
//!    pair, made for this and removed at the end): the kernel's lookup skips a listener bound
//!    to another device than a SYN came in on, so from that instant every new connection to
//!    those addresses finds the static apiserver's wildcard socket, while the handshakes already
//!    under way still complete into the taken sockets. Then they are acknowledged (the proxy
//!    stops accepting and closes its copies), what they queue is accepted and forwarded to the
//!    static apiserver for 50 ms, and they are closed with an empty queue: nothing refused,
//!    reset or delayed. Without a device (no dummy or veth driver) a socket filter
//!    drops new SYNs instead while the queue is emptied: a client whose SYN falls in those
//!    milliseconds sends it again after 1 s and then reaches the static apiserver;
//! 5. exits 0 once nothing but the wildcard socket listens on the port (and the connections it
//!    forwarded have ended, or `--drain-timeout` has passed).
//!
//! Exit 2 on bad input (nothing touched), 1 when it failed or gave up: the manifest is removed
//! again if no socket was handed over yet (the Deployment keeps serving; only `SO_REUSEPORT` and
//! the owner of its sockets were changed).

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::unistd::{Gid, Uid};
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::handoff::codec::{Message, PeerState};
use crate::handoff::server::{self, DirError, Peer, Reply, Responder};
use crate::node::api::ApiClient;
use crate::node::migration::migrate::{find_holder, GetfdError, PtraceContext};
use crate::node::object::{self, ObjectMeta, Pod};
use crate::{node::migration::served, sys};

/// Why `migrate-back` failed. Its [`CommandError::is_bad_input`](crate::base::exit::CommandError::is_bad_input) tells exit code 2 from 1.
/// The cause is the source: print with `{:#}`. The line has always begun
/// `migrate: migrate-back:` (the command was written as a part of `migrate`), and keeps doing so.
#[derive(Debug, thiserror::Error)]
pub enum MigrateBackError {
    /// Bad input: nothing was touched.
    #[error("migrate: migrate-back")]
    BadInput(#[from] BackInput),
    /// It failed or gave up.
    #[error("migrate: migrate-back")]
    Failed(#[from] BackFailure),
}

impl crate::base::exit::CommandError for MigrateBackError {
    /// Bad input: nothing was touched (exit code 2).
    fn is_bad_input(&self) -> bool {
        matches!(self, MigrateBackError::BadInput(_))
    }

    /// The error and its causes: its message does not repeat them.
    fn line(&self) -> String {
        crate::base::exit::chain(self)
    }
}

/// What `migrate-back` refuses before it changes anything.
#[derive(Debug, thiserror::Error)]
pub enum BackInput {
    #[error("must run as root: it reaches the proxies' sockets with pidfd_getfd (CAP_SYS_PTRACE) and writes the static pod directory")]
    NotRoot,
    #[error("--manifest {}", .path.display())]
    ReadManifest {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("--manifest {}", .path.display())]
    Manifest {
        path: PathBuf,
        #[source]
        source: ManifestError,
    },
    #[error("--static-pod-dir {}: not a directory", .0.display())]
    StaticPodDir(PathBuf),
    #[error("{} exists already: kubeadm's apiserver is back, or another way back is under way", .0.display())]
    ManifestInPlace(PathBuf),
    #[error(transparent)]
    HandoffDir(#[from] DirError),
    #[error("{0} listens already (a wildcard socket: is kubeadm's apiserver running?)")]
    WildcardListening(SocketAddr),
    #[error("nothing listens on port {port}: no proxy to take the addresses from; put the manifest into {} yourself", .static_pod_dir.display())]
    NothingListens { port: u16, static_pod_dir: PathBuf },
    #[error("the manifest runs {image} but the apiserver serving now is {running}: render kubeadm's manifest from the ClusterConfiguration of the version you run (kubeadm-config's kubernetesVersion), not an older copy; or pass --allow-version-change")]
    VersionDiffers { image: String, running: String },
    #[error("--ca-file {}: {error}", .path.display())]
    CaFile {
        path: PathBuf,
        error: crate::node::api::AnonymousError,
    },
}

/// Why kubeadm's manifest does not give a way back without refusals.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ManifestError {
    #[error("not kubeadm's kube-apiserver manifest (no `- kube-apiserver` command)")]
    NotKubeApiserver,
    #[error("it lacks --permit-port-sharing=true: without SO_REUSEPORT the static apiserver cannot bind its port beside the proxies (render it with the patch of docs/runbooks/going-back.md)")]
    NoPortSharing,
    #[error("--bind-address={0}: the way back is kubeadm's wildcard listener")]
    BindAddress(String),
    #[error("--secure-port={0}")]
    SecurePort(String),
    #[error("no image")]
    NoImage,
    #[error("not one pod: {0}")]
    NotOnePod(String),
}

/// What went wrong on the way back.
#[derive(Debug, thiserror::Error)]
pub enum BackFailure {
    #[error("runtime")]
    Runtime(#[source] io::Error),
    /// Each address tried, and what it answered.
    #[error("cannot read the running apiserver's /version: {}", .0.join("; "))]
    Version(Vec<String>),
    #[error("no process found holding {local} (inode {inode}){}", .ptrace.as_ref().map_or(String::new(), |p| format!("; the descriptors of {denied} processes could not be read: {}", p.explain())))]
    NoHolder {
        local: SocketAddr,
        inode: u64,
        denied: usize,
        ptrace: Option<PtraceContext>,
    },
    #[error(transparent)]
    Getfd(#[from] GetfdError),
    #[error("the taken descriptor")]
    TakenStat(#[source] nix::errno::Errno),
    #[error("descriptor {fd} of process {pid} is not {local} any more")]
    Replaced {
        fd: i32,
        pid: u32,
        local: SocketAddr,
    },
    #[error("SO_REUSEPORT on {local}")]
    ReusePort {
        local: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("giving {local} to root")]
    Chown {
        local: SocketAddr,
        #[source]
        source: nix::errno::Errno,
    },
    #[error("no free address in 127.0.0.0/24 to reach the static apiserver")]
    NoDirectAddress,
    #[error("--handoff-dir")]
    HandoffSocket(#[source] io::Error),
    #[error("cannot write {}", .path.display())]
    WriteManifest {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(transparent)]
    GaveUp(#[from] GaveUp),
}

/// What the command reads from kubeadm's manifest (YAML as kubeadm writes it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// The kube-apiserver image.
    pub image: String,
    /// Its tag (`v1.37.2`), if it has one.
    pub tag: Option<String>,
    /// `--secure-port` (6443 if absent).
    pub port: u16,
}

/// The value of `- --flag=value` lines of a static pod manifest.
fn manifest_flag<'a>(text: &'a str, flag: &str) -> Option<&'a str> {
    text.lines().find_map(|l| {
        l.trim_start()
            .strip_prefix("- ")?
            .trim()
            .trim_matches('"')
            .strip_prefix(flag)?
            .strip_prefix('=')
    })
}

/// Checks kubeadm's manifest for a way back without refusals. Pure.
pub fn parse_manifest(text: &str) -> Result<Manifest, ManifestError> {
    if !text.lines().any(|l| l.trim() == "- kube-apiserver") {
        return Err(ManifestError::NotKubeApiserver);
    }
    if manifest_flag(text, "--permit-port-sharing") != Some("true") {
        return Err(ManifestError::NoPortSharing);
    }
    if let Some(b) = manifest_flag(text, "--bind-address") {
        if !b.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
            return Err(ManifestError::BindAddress(b.to_owned()));
        }
    }
    let port = match manifest_flag(text, "--secure-port") {
        Some(p) => p
            .parse()
            .map_err(|_| ManifestError::SecurePort(p.to_owned()))?,
        None => 6443,
    };
    let image = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("image:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .filter(|v| !v.is_empty())
        .ok_or(ManifestError::NoImage)?;
    let name = image.split('@').next().unwrap_or(&image);
    let tag = name
        .rfind(':')
        .filter(|i| !name[*i..].contains('/'))
        .map(|i| name[i + 1..].to_owned());
    Ok(Manifest { image, tag, port })
}

/// The sockets listening on `port` in this network namespace.
fn listening(port: u16) -> Vec<served::TcpEntry> {
    served::tcp_entries()
        .into_iter()
        .filter(|e| e.state == 0x0A && e.local.port() == port)
        .collect()
}

/// What `migrate-back` is asked for (its flags, `cli::MigrateBackArgs`).
#[derive(Debug, Clone)]
pub struct Options {
    /// kubeadm's kube-apiserver manifest for the version that runs now, with
    /// --permit-port-sharing=true (docs/runbooks/going-back.md says how kubeadm renders it);
    /// put into --static-pod-dir as kube-apiserver.yaml.
    pub manifest: PathBuf,

    /// The kubelet's static pod directory.
    pub static_pod_dir: PathBuf,

    /// The proxies' handoff directory (owned by --uid, mode 0700): the Deployment's proxy hands
    /// its listening sockets over here as it drains.
    pub handoff_dir: PathBuf,

    /// The proxies' uid (peers authenticate each other by uid).
    pub uid: u32,

    /// The proxies' gid (default: --uid).
    pub gid: Option<u32>,

    /// The cluster CA: the apiservers' /version and /readyz are read verified against it, under
    /// the name `kubernetes`.
    pub ca_file: PathBuf,

    /// Go ahead even though the manifest's image tag is not the version the apiserver serving
    /// now reports.
    pub allow_version_change: bool,

    /// How long to wait for the static apiserver and then for the Deployment's proxies to hand
    /// their sockets over (delete the Deployment meanwhile).
    pub timeout: Duration,

    /// How long connections still queued on a taken socket, forwarded to the static apiserver,
    /// may go on before they are closed.
    pub drain_timeout: Duration,
}

/// Runs the whole way back (see the module documentation). Must be called before any other
/// thread exists: it changes the process's effective credentials for a moment.
pub fn run(args: &Options) -> Result<(), MigrateBackError> {
    let (text, manifest, target, held) = check_input(args)?;
    let port = manifest.port;
    let runtime = crate::base::runtime::current_thread().map_err(BackFailure::Runtime)?;

    // 1. The version that serves now.
    let running = runtime.block_on(running_version(&held, &args.ca_file))?;
    match &manifest.tag {
        Some(tag) if *tag == running => {}
        _ if args.allow_version_change => {
            tracing::warn!(image = %manifest.image, running, "migrate-back: the manifest's version differs from the one serving (--allow-version-change)")
        }
        _ => {
            return Err(BackInput::VersionDiffers {
                image: manifest.image,
                running,
            }
            .into())
        }
    }

    // 2. SO_REUSEPORT and root on every socket of the port, through a duplicate.
    for e in &held {
        share_port_with_root(e)?;
    }

    // 3. Where the static apiserver alone will answer, and the handoff socket as the proxies'
    // uid (their peer check reads the uid the socket was listened with).
    let direct = (2..=254u8)
        .map(|d| SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, d)), port))
        .find(|a| {
            !held
                .iter()
                .any(|e| served::canonical(e.local.ip()) == a.ip())
        })
        .ok_or(BackFailure::NoDirectAddress)?;
    let (listener, path) = runtime
        .block_on(async {
            bind_handoff_as(&args.handoff_dir, args.uid, args.gid.unwrap_or(args.uid))
        })
        .map_err(BackFailure::HandoffSocket)?;
    // Durably, kubeadm's mode: after a power loss from here on the kubelet runs it.
    crate::base::fsutil::write_durable(
        &target,
        text.as_bytes(),
        crate::node::manifest::MANIFEST_MODE,
    )
    .map_err(|source| BackFailure::WriteManifest {
        path: target.clone(),
        source,
    })?;
    tracing::info!(manifest = %target.display(), image = %manifest.image, "migrate-back: kubeadm's manifest is in place; the kubelet starts the static apiserver beside the proxies");

    // 4. Wait for it, then for the proxies' sockets.
    let result = runtime.block_on(serve(args, listener, direct, port));
    let _ = std::fs::remove_file(&path);
    if let Err(Gave { taken: 0, .. }) = &result {
        let _ = std::fs::remove_file(&target);
        tracing::warn!(manifest = %target.display(), "migrate-back: no socket was handed over; the manifest is removed again (the Deployment keeps serving)");
    }
    Ok(result.map_err(|gave| BackFailure::from(gave.why))?)
}

/// Checks everything before anything is touched: kubeadm's manifest (its text, what it says),
/// where it goes, the handoff directory, and the sockets listening on its port now.
fn check_input(
    args: &Options,
) -> Result<(String, Manifest, PathBuf, Vec<served::TcpEntry>), BackInput> {
    if !nix::unistd::geteuid().is_root() {
        return Err(BackInput::NotRoot);
    }
    let path = || args.manifest.clone();
    let text =
        std::fs::read_to_string(&args.manifest).map_err(|source| BackInput::ReadManifest {
            path: path(),
            source,
        })?;
    let manifest = parse_manifest(&text).map_err(|source| BackInput::Manifest {
        path: path(),
        source,
    })?;
    let text = with_uid(&text).map_err(|source| BackInput::Manifest {
        path: path(),
        source,
    })?;
    let port = manifest.port;
    if !args.static_pod_dir.is_dir() {
        return Err(BackInput::StaticPodDir(args.static_pod_dir.clone()));
    }
    let target = args.static_pod_dir.join("kube-apiserver.yaml");
    if target.exists() {
        return Err(BackInput::ManifestInPlace(target));
    }
    server::check_dir_of(&args.handoff_dir, args.uid)?;
    let held = listening(port);
    if let Some(w) = held.iter().find(|e| e.local.ip().is_unspecified()) {
        return Err(BackInput::WildcardListening(w.local));
    }
    if held.is_empty() {
        return Err(BackInput::NothingListens {
            port,
            static_pod_dir: args.static_pod_dir.clone(),
        });
    }
    Ok((text, manifest, target, held))
}

/// The manifest with a `metadata.uid` (its own if it has one): the UID the kubelet runs the
/// static apiserver under is then the file's, wherever the file is read from, so that
/// `kubeadm-sync --undo` can carry it into kubeadm's directory, and a kubelet of another minor
/// keeps the pod ([`crate::node::manifest::static_uid`]: without one the kubelet derives it
/// from the file's path and from the pod as its version decodes it).
pub fn with_uid(text: &str) -> Result<String, ManifestError> {
    let parse = |t: &str| {
        crate::base::yaml::parse_documents(t).map_err(|e| ManifestError::NotOnePod(e.to_string()))
    };
    // Read for its UID and to compare: the text edited keeps a field this build does not know,
    // which this reading ignores; only the pod written anew must have all of them (below).
    let read = |doc: &serde_json::Value| {
        serde_json::from_value::<Pod>(doc.clone())
            .map_err(|e| ManifestError::NotOnePod(e.to_string()))
    };
    let mut docs = parse(text)?;
    if docs.len() != 1 || !docs[0].is_object() {
        return Err(ManifestError::NotOnePod(format!(
            "{} documents, one pod expected",
            docs.len()
        )));
    }
    let pod = read(&docs[0])?;
    if pod.metadata.uid.as_deref().is_some_and(|u| !u.is_empty()) {
        return Ok(text.to_owned());
    }
    // Of the document as kubeadm-sync reads it (its nulls included): the same file, the same UID.
    let uid = crate::node::manifest::static_uid(
        &crate::node::manifest::hostname(),
        "kube-apiserver.yaml",
        &docs[0],
    );
    let mut want = pod.clone();
    want.metadata.uid = Some(uid.clone());
    // kubeadm's text with one line added (what an operator diffs), when that reads back as
    // the pod with the UID; else the pod written anew.
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let edited = match lines.iter().position(|l| l.trim_end() == "metadata:") {
        Some(i) => {
            let indent = lines[i + 1..]
                .iter()
                .find(|l| !l.trim().is_empty())
                .map(|l| l.len() - l.trim_start().len())
                .filter(|n| *n > 0)
                .unwrap_or(2);
            let mut t: String = lines[..=i].concat();
            t.push_str(&format!("{}uid: {uid}\n", " ".repeat(indent)));
            t.push_str(&lines[i + 1..].concat());
            t
        }
        // No metadata at all (one in flow style, even empty, is a key the line would repeat).
        None if pod.metadata == ObjectMeta::default() => {
            let sep = if text.ends_with('\n') { "" } else { "\n" };
            format!("{text}{sep}metadata:\n  uid: {uid}\n")
        }
        None => String::new(),
    };
    if parse(&edited).is_ok_and(|d| d.len() == 1 && read(&d[0]).is_ok_and(|p| p == want)) {
        return Ok(edited);
    }
    // Written anew: refused if it would lose a field.
    let mut anew = object::from_value::<Pod>(docs.swap_remove(0))
        .map_err(|e| ManifestError::NotOnePod(e.to_string()))?;
    anew.metadata.uid = Some(uid);
    Ok(crate::base::yaml::to_yaml(&object::to_value(&anew)))
}

/// Sets `SO_REUSEPORT` on the socket listening at `e` and gives it to root, through a
/// duplicate taken from the process holding it: it keeps serving there.
fn share_port_with_root(e: &served::TcpEntry) -> Result<(), BackFailure> {
    let (pid, fd, inode) =
        find_holder(&[e.inode], None).map_err(|denied| BackFailure::NoHolder {
            local: e.local,
            inode: e.inode,
            denied: denied.len(),
            ptrace: (!denied.is_empty()).then(PtraceContext::read),
        })?;
    let taken = sys::take_fd_of(pid, fd).map_err(|err| GetfdError::new(err, pid, fd))?;
    let stat = nix::sys::stat::fstat(taken.as_raw_fd()).map_err(BackFailure::TakenStat)?;
    if stat.st_ino != inode {
        return Err(BackFailure::Replaced {
            fd,
            pid,
            local: e.local,
        });
    }
    socket2::SockRef::from(&taken)
        .set_reuse_port(true)
        .map_err(|source| BackFailure::ReusePort {
            local: e.local,
            source,
        })?;
    nix::unistd::fchown(
        taken.as_raw_fd(),
        Some(Uid::from_raw(0)),
        Some(Gid::from_raw(0)),
    )
    .map_err(|source| BackFailure::Chown {
        local: e.local,
        source,
    })?;
    drop(taken);
    tracing::info!(listen.addr = %e.local, pid, fd, was_uid = stat.st_uid, "migrate-back: SO_REUSEPORT set and the socket given to root (it stays with its process)");
    Ok(())
}

/// The apiserver's `/version` answer, of which only `gitVersion` is read.
#[derive(serde::Deserialize)]
struct Version {
    #[serde(rename = "gitVersion")]
    git_version: Option<String>,
}

/// The `gitVersion` the apiserver behind one of `held` reports.
async fn running_version(held: &[served::TcpEntry], ca: &Path) -> Result<String, MigrateBackError> {
    let mut errors = Vec::new();
    for e in held {
        let addr = SocketAddr::new(served::canonical(e.local.ip()), e.local.port());
        let api =
            ApiClient::anonymous(addr, ca, "kubernetes").map_err(|error| BackInput::CaFile {
                path: ca.to_owned(),
                error,
            })?;
        match api.get_as::<Version>("/version").await {
            Ok(v) => {
                if let Some(version) = v.git_version {
                    return Ok(version);
                }
                errors.push(format!("{addr}: no gitVersion"));
            }
            Err(err) => errors.push(format!("{addr}: {err}")),
        }
    }
    Err(BackFailure::Version(errors).into())
}

/// Binds the handoff socket ([`server::bind`]) as `uid`/`gid`, then takes root back.
fn bind_handoff_as(dir: &Path, uid: u32, gid: u32) -> io::Result<(UnixListener, PathBuf)> {
    nix::unistd::setegid(Gid::from_raw(gid))?;
    nix::unistd::seteuid(Uid::from_raw(uid))?;
    let bound = server::bind(dir);
    nix::unistd::seteuid(Uid::from_raw(0))?;
    nix::unistd::setegid(Gid::from_raw(0))?;
    bound
}

/// A network device that carries no traffic, for `SO_BINDTODEVICE`: a dummy, else one end of
/// a veth pair (both down); removed when dropped.
struct Sink(String);

impl Sink {
    fn create() -> std::io::Result<Self> {
        use crate::backends::routes::{add_link, Link};
        let name = format!("kapmb{}", std::process::id() % 100_000);
        let peer = format!("{name}p");
        match add_link(&name, Link::Dummy) {
            Ok(()) => Ok(Sink(name)),
            Err(dummy) => match add_link(&name, Link::Veth { peer: &peer }) {
                Ok(()) => Ok(Sink(name)),
                Err(veth) => Err(std::io::Error::other(format!(
                    "neither a dummy ({dummy}) nor a veth pair ({veth}) could be made"
                ))),
            },
        }
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        if let Err(e) = crate::backends::routes::delete_link(&self.0) {
            tracing::warn!(device = %self.0, error = %e, "migrate-back: the device for the taken sockets could not be removed");
        }
    }
}

/// Why the wait ended without success.
#[derive(Debug, thiserror::Error)]
pub enum GaveUp {
    #[error("{0}")]
    Client(crate::node::api::AnonymousError),
    #[error(transparent)]
    Signal(io::Error),
    #[error("gave up after {timeout:?}: {}; still listening: {left:?}", if *.ready { "the Deployment's sockets were not all handed over" } else { "the static apiserver never got ready" })]
    Timeout {
        timeout: Duration,
        ready: bool,
        left: Vec<SocketAddr>,
    },
    #[error("terminated")]
    Terminated,
    #[error("interrupted")]
    Interrupted,
}

/// How the wait ended without success: sockets handed over so far, and why.
#[derive(Debug)]
struct Gave {
    taken: usize,
    why: GaveUp,
}

impl From<GaveUp> for Gave {
    fn from(why: GaveUp) -> Self {
        Gave { taken: 0, why }
    }
}

/// Serves the handoff socket until nothing but the wildcard socket listens on `port`.
async fn serve(
    args: &Options,
    listener: UnixListener,
    direct: SocketAddr,
    port: u16,
) -> Result<(), Gave> {
    let api = ApiClient::anonymous(direct, &args.ca_file, "kubernetes").map_err(GaveUp::Client)?;
    let sink = match Sink::create() {
        Ok(s) => {
            tracing::info!(device = %s.0, "migrate-back: a device that carries no traffic, for the taken sockets");
            Some(s)
        }
        Err(e) => {
            tracing::warn!(error = %e, "migrate-back: no device for the taken sockets; new connections arriving while they close wait for their SYN to be sent again (1 s)");
            None
        }
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(GaveUp::Signal)?;
    let back = Arc::new(Back {
        uid: args.uid,
        port,
        direct,
        forwards: TaskTracker::new(),
        sink,
        ready: AtomicBool::new(false),
        taken: AtomicUsize::new(0),
    });
    let (stop, tasks) = (CancellationToken::new(), TaskTracker::new());
    tasks.spawn(server::serve(
        back.clone(),
        listener,
        stop.clone(),
        tasks.clone(),
    ));
    tracing::info!(timeout = ?args.timeout, direct = %direct, "migrate-back: waiting for the static apiserver to be ready");
    let result = watch(args, &back, &api, &mut term).await;
    // The server and its exchanges (bounded) end; the sink goes with the last of them.
    stop.cancel();
    tasks.close();
    tasks.wait().await;
    result
}

/// Follows the static apiserver's readiness and what listens on the port until only its
/// wildcard socket does, or `--timeout`, or a signal.
async fn watch(
    args: &Options,
    back: &Back,
    api: &ApiClient,
    term: &mut tokio::signal::unix::Signal,
) -> Result<(), Gave> {
    let (direct, port) = (back.direct, back.port);
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let gave = |why| Gave {
        taken: back.taken.load(Ordering::SeqCst),
        why,
    };
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = term.recv() => return Err(gave(GaveUp::Terminated)),
            _ = tokio::signal::ctrl_c() => return Err(gave(GaveUp::Interrupted)),
        }
        let ready = back.ready.load(Ordering::SeqCst);
        if !ready && api.get("/readyz").await.is_ok() {
            back.ready.store(true, Ordering::SeqCst);
            tracing::info!(direct = %direct, "migrate-back: the static apiserver is ready; delete the Deployment now (kubectl -n kube-system delete deployment kube-apiserver): its proxy hands its sockets over here as it drains");
        }
        let ready = back.ready.load(Ordering::SeqCst);
        let taken = back.taken.load(Ordering::SeqCst);
        let left: Vec<SocketAddr> = listening(port)
            .iter()
            .filter(|e| !e.local.ip().is_unspecified())
            .map(|e| e.local)
            .collect();
        if ready && left.is_empty() && taken > 0 {
            back.forwards.close();
            if tokio::time::timeout(args.drain_timeout, back.forwards.wait())
                .await
                .is_err()
            {
                tracing::warn!(
                    "migrate-back: forwarded connections still open at --drain-timeout; closed"
                );
            }
            tracing::info!(
                sockets = taken,
                "migrate-back: done: only kubeadm's apiserver listens on the port"
            );
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(gave(GaveUp::Timeout {
                timeout: args.timeout,
                ready,
                left,
            }));
        }
    }
}

/// The handoff server of `migrate-back`: ready once the static apiserver is; takes a draining
/// proxy's listening sockets and closes them with nothing refused.
struct Back {
    /// The proxies' uid: the only peer allowed.
    uid: u32,
    port: u16,
    /// Where the static apiserver alone answers, for the connections still queued.
    direct: SocketAddr,
    /// The queued connections carried to the static apiserver.
    forwards: TaskTracker,
    sink: Option<Sink>,
    /// The static apiserver answered `/readyz`.
    ready: AtomicBool,
    /// Listening sockets taken over so far.
    taken: AtomicUsize,
}

impl Responder for Back {
    const NAME: &'static str = "migrate-back";

    fn allows(&self, uid: u32) -> bool {
        uid == self.uid
    }

    fn status(&self) -> (PeerState, bool) {
        (PeerState::MigratingBack, self.ready.load(Ordering::SeqCst))
    }

    async fn adopt(&self, peer: &Peer, addrs: &[String], fds: Vec<OwnedFd>) -> Reply {
        if !self.ready.load(Ordering::SeqCst) {
            return Reply::Answer(Message::Refuse {
                reason: "the static apiserver is not ready yet".into(),
            });
        }
        let n = self.take_and_close(peer, addrs, fds).await;
        self.taken.fetch_add(n, Ordering::SeqCst);
        Reply::Answered
    }

    fn refuse(&self, _pid: i32, _request: &Message) -> Message {
        Message::Refuse {
            reason: "migrating back: only status requests and adoptions are answered".into(),
        }
    }
}

impl Back {
    /// Takes a draining proxy's listening sockets and closes them with nothing refused or reset:
    /// new connections turned away from them first (bound to the sink, or else dropped by a
    /// filter), then acknowledged, their queue accepted and forwarded, then closed. Returns how
    /// many were offered.
    async fn take_and_close(&self, peer: &Peer, addrs: &[String], fds: Vec<OwnedFd>) -> usize {
        let (pid, port, direct, forwards) = (peer.pid, self.port, self.direct, &self.forwards);
        let sink = self.sink.as_ref();
        let mut kept = Vec::new();
        for (fd, addr) in fds.into_iter().zip(addrs) {
            match sys::listening_tcp_addr(fd.as_fd()) {
                Ok(a) if a.port() == port && !a.ip().is_unspecified() => {}
                other => {
                    tracing::warn!(peer.pid = pid, offered = %addr, got = ?other, "migrate-back: not a listening socket of the port; left alone");
                    continue;
                }
            }
            let turned = match sink {
                Some(dev) => socket2::SockRef::from(&fd)
                    .bind_device(Some(dev.0.as_bytes()))
                    .map_err(|e| format!("SO_BINDTODEVICE {}: {e}", dev.0)),
                None => sys::drop_new_connections(fd.as_fd()).map_err(|e| format!("filter: {e}")),
            };
            if let Err(e) = turned {
                tracing::warn!(listen.addr = %addr, error = %e, "migrate-back: cannot turn new connections away; left to the proxy");
                continue;
            }
            match sys::cookie(fd.as_fd()) {
                Ok(cookie) => kept.push((addr.clone(), cookie, fd)),
                Err(e) => {
                    tracing::warn!(listen.addr = %addr, error = %e, "migrate-back: no SO_COOKIE")
                }
            }
        }
        if sink.is_none() {
            // The handshakes under way when the filter went on complete now and the proxy, still
            // accepting until our answer, takes them.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let cookies = kept.iter().map(|(_, c, _)| *c).collect();
        if let Err(e) = peer.send(&Message::Ack { cookies }, &[]).await {
            tracing::warn!(peer.pid = pid, error = %e, "migrate-back: the acknowledgement failed; the proxy keeps its sockets");
            return 0;
        }
        let listeners: Vec<(String, std::net::TcpListener)> = kept
            .into_iter()
            .filter_map(|(addr, _, fd)| {
                let l = std::net::TcpListener::from(fd);
                l.set_nonblocking(true).ok()?;
                Some((addr, l))
            })
            .collect();
        let sweep = || {
            let mut n = 0;
            for (_, l) in &listeners {
                while let Ok((client, peer)) = l.accept() {
                    n += 1;
                    forwards.spawn(forward(client, direct, peer));
                }
            }
            n
        };
        let mut forwarded = sweep();
        // With the device no new connection reaches these sockets: what may still arrive are the
        // handshakes that were under way (one round trip).
        if sink.is_some() {
            tokio::time::sleep(Duration::from_millis(50)).await;
            forwarded += sweep();
        }
        for (addr, _) in &listeners {
            tracing::info!(listen.addr = %addr, "migrate-back: listening socket taken from the draining proxy and closed (new connections go to the static apiserver)");
        }
        drop(listeners);
        let turned_away = if sink.is_some() { "device" } else { "filter" };
        tracing::info!(
            peer.pid = pid,
            sockets = addrs.len(),
            forwarded,
            turned_away,
            "migrate-back: the proxy's listening sockets are closed with nothing reset"
        );
        addrs.len()
    }
}

/// Carries one connection that was still queued to the static apiserver.
async fn forward(client: std::net::TcpStream, direct: SocketAddr, peer: SocketAddr) {
    let _ = client.set_nonblocking(true);
    let Ok(mut client) = tokio::net::TcpStream::from_std(client) else {
        return;
    };
    match tokio::net::TcpStream::connect(direct).await {
        Ok(mut backend) => {
            let _ = tokio::io::copy_bidirectional(&mut client, &mut backend).await;
        }
        Err(e) => {
            tracing::warn!(client.addr = %peer, error = %e, "migrate-back: cannot reach the static apiserver for a queued connection")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KUBEADM: &str = "apiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - command:\n    - kube-apiserver\n    - --advertise-address=192.0.2.10\n    - --secure-port=6443\n    - --permit-port-sharing=true\n    image: registry.k8s.io/kube-apiserver:v1.37.2\n    name: kube-apiserver\n";

    #[test]
    fn the_installed_manifest_carries_a_uid_of_its_content() {
        let a = with_uid(KUBEADM).unwrap();
        let docs = crate::base::yaml::parse_documents(&a).unwrap();
        let pod: Pod = object::from_value(docs[0].clone()).unwrap();
        let uid = pod.metadata.uid.unwrap();
        assert_eq!(uid.len(), 32);
        // The same pod again: the same UID; another: another; one given: kept as it is.
        assert_eq!(with_uid(KUBEADM).unwrap(), a);
        let other = with_uid(&KUBEADM.replace("v1.37.2", "v1.37.3")).unwrap();
        assert!(!other.contains(&uid));
        assert_eq!(with_uid(&a).unwrap(), a);
        assert!(matches!(
            with_uid("a: 1\n---\nb: 2\n"),
            Err(ManifestError::NotOnePod(_))
        ));
        // Without metadata: added at the end; kubeadm's text kept, one line added under its
        // metadata.
        assert!(a.starts_with(KUBEADM) && a.ends_with(&format!("metadata:\n  uid: {uid}\n")));
        let kubeadms = KUBEADM.replace(
            "kind: Pod\n",
            "kind: Pod\nmetadata:\n  name: kube-apiserver\n  namespace: kube-system\n",
        );
        let b = with_uid(&kubeadms).unwrap();
        let added: Vec<&str> = b
            .lines()
            .filter(|l| !kubeadms.lines().any(|k| k == *l))
            .collect();
        assert_eq!(added.len(), 1, "{b}");
        assert!(added[0].starts_with("  uid: "), "{b}");
        assert_eq!(b.replace(&format!("{}\n", added[0]), ""), kubeadms);
        // Metadata in flow style: the pod written anew, with the UID.
        for metadata in ["{name: kube-apiserver}", "{}"] {
            let flow =
                KUBEADM.replace("kind: Pod\n", &format!("kind: Pod\nmetadata: {metadata}\n"));
            let c = with_uid(&flow).unwrap();
            let docs = crate::base::yaml::parse_documents(&c).unwrap();
            let pod: Pod = object::from_value(docs[0].clone()).unwrap();
            assert_eq!(pod.metadata.uid.map(|u| u.len()), Some(32), "{c}");
            assert_eq!(with_uid(&c).unwrap(), c);
        }
        // A field this build does not know: kept in kubeadm's text; refused, named, rather than
        // written anew without it.
        let newer = KUBEADM.replace(
            "    name: kube-apiserver\n",
            "    name: kube-apiserver\n    future: 1\n",
        );
        let kept = with_uid(&newer).unwrap();
        assert!(kept.starts_with(&newer), "{kept}");
        let newer = newer.replace("kind: Pod\n", "kind: Pod\nmetadata: {}\n");
        match with_uid(&newer) {
            Err(ManifestError::NotOnePod(m)) => {
                assert!(m.contains("(spec.containers[0].future;"), "{m}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn kubeadms_manifest_is_read_and_checked() {
        let m = parse_manifest(KUBEADM).unwrap();
        assert_eq!(m.image, "registry.k8s.io/kube-apiserver:v1.37.2");
        assert_eq!(m.tag.as_deref(), Some("v1.37.2"));
        assert_eq!(m.port, 6443);
        let no_sharing = KUBEADM.replace("    - --permit-port-sharing=true\n", "");
        assert!(parse_manifest(&no_sharing)
            .unwrap_err()
            .to_string()
            .contains("--permit-port-sharing=true"));
        let bound = KUBEADM.replace("--secure-port=6443", "--bind-address=192.0.2.10");
        assert!(parse_manifest(&bound)
            .unwrap_err()
            .to_string()
            .contains("--bind-address"));
        let port = KUBEADM.replace("--secure-port=6443", "--secure-port=8443");
        assert_eq!(parse_manifest(&port).unwrap().port, 8443);
        let digest = KUBEADM.replace(":v1.37.2", "@sha256:ab");
        assert_eq!(parse_manifest(&digest).unwrap().tag, None);
        assert!(parse_manifest("kind: Pod\n").is_err());
    }

    /// The error line main prints (`CommandError::line`) reads as it always did; the exit code
    /// follows the kind.
    #[test]
    fn errors_print_their_causes_on_one_line() {
        use crate::base::exit::CommandError;
        let line = |e: MigrateBackError| (e.is_bad_input(), e.line());
        assert_eq!(
            line(BackInput::StaticPodDir("/x".into()).into()),
            (
                true,
                "migrate: migrate-back: --static-pod-dir /x: not a directory".into()
            )
        );
        let manifest = BackInput::Manifest {
            path: "/m.yaml".into(),
            source: ManifestError::NoImage,
        };
        assert_eq!(
            line(manifest.into()),
            (
                true,
                "migrate: migrate-back: --manifest /m.yaml: no image".into()
            )
        );
        assert_eq!(
            line(BackFailure::NoDirectAddress.into()),
            (
                false,
                "migrate: migrate-back: no free address in 127.0.0.0/24 to reach the static apiserver".into()
            )
        );
        let timeout = GaveUp::Timeout {
            timeout: Duration::from_secs(5),
            ready: true,
            left: vec![],
        };
        assert_eq!(
            line(BackFailure::from(timeout).into()).1,
            "migrate: migrate-back: gave up after 5s: the Deployment's sockets were not all handed over; still listening: []"
        );
    }
}
