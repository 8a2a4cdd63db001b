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
//!    reset or delayed. Without a device (no `ip`, no dummy or veth driver) a socket filter
//!    drops new SYNs instead while the queue is emptied: a client whose SYN falls in those
//!    milliseconds sends it again after 1 s and then reaches the static apiserver;
//! 5. exits 0 once nothing but the wildcard socket listens on the port (and the connections it
//!    forwarded have ended, or `--drain-timeout` has passed).
//!
//! Exit 2 on bad input (nothing touched), 1 when it failed or gave up: the manifest is removed
//! again if no socket was handed over yet (the Deployment keeps serving; only `SO_REUSEPORT` and
//! the owner of its sockets were changed).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::unistd::{Gid, Uid};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::task::TaskTracker;

use crate::checkpoint::ApiClient;
use crate::cli::MigrateBackArgs;
use crate::handoff::codec::Message;
use crate::handoff::{wire, EXCHANGE_TIMEOUT};
use crate::migrate::{check_handoff_dir, find_holder, MigrateError, PtraceContext};
use crate::{served, sys};

fn bad(msg: impl Into<String>) -> MigrateError {
    MigrateError::BadInput(format!("migrate-back: {}", msg.into()))
}

fn failed(msg: impl Into<String>) -> MigrateError {
    MigrateError::Failed(format!("migrate-back: {}", msg.into()))
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
pub fn parse_manifest(text: &str) -> Result<Manifest, String> {
    if !text.lines().any(|l| l.trim() == "- kube-apiserver") {
        return Err("not kubeadm's kube-apiserver manifest (no `- kube-apiserver` command)".into());
    }
    if manifest_flag(text, "--permit-port-sharing") != Some("true") {
        return Err("it lacks --permit-port-sharing=true: without SO_REUSEPORT the static apiserver cannot bind its port beside the proxies (render it with the patch of docs/runbooks/going-back.md)".into());
    }
    if let Some(b) = manifest_flag(text, "--bind-address") {
        if !b.parse::<IpAddr>().is_ok_and(|ip| ip.is_unspecified()) {
            return Err(format!(
                "--bind-address={b}: the way back is kubeadm's wildcard listener"
            ));
        }
    }
    let port = match manifest_flag(text, "--secure-port") {
        Some(p) => p.parse().map_err(|_| format!("--secure-port={p}"))?,
        None => 6443,
    };
    let image = text
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("image:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .filter(|v| !v.is_empty())
        .ok_or("no image")?;
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

/// Runs the whole way back (see the module documentation). Must be called before any other
/// thread exists: it changes the process's effective credentials for a moment.
pub fn run(args: &MigrateBackArgs) -> Result<(), MigrateError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(bad("must run as root: it reaches the proxies' sockets with pidfd_getfd (CAP_SYS_PTRACE) and writes the static pod directory"));
    }
    let text = std::fs::read_to_string(&args.manifest)
        .map_err(|e| bad(format!("--manifest {}: {e}", args.manifest.display())))?;
    let manifest = parse_manifest(&text)
        .map_err(|e| bad(format!("--manifest {}: {e}", args.manifest.display())))?;
    let port = manifest.port;
    if !args.static_pod_dir.is_dir() {
        return Err(bad(format!(
            "--static-pod-dir {}: not a directory",
            args.static_pod_dir.display()
        )));
    }
    let target = args.static_pod_dir.join("kube-apiserver.yaml");
    if target.exists() {
        return Err(bad(format!(
            "{} exists already: kubeadm's apiserver is back, or another way back is under way",
            target.display()
        )));
    }
    check_handoff_dir(&args.handoff_dir, args.uid).map_err(bad)?;
    let held = listening(port);
    if let Some(w) = held.iter().find(|e| e.local.ip().is_unspecified()) {
        return Err(bad(format!(
            "{} listens already (a wildcard socket: is kubeadm's apiserver running?)",
            w.local
        )));
    }
    if held.is_empty() {
        return Err(bad(format!(
            "nothing listens on port {port}: no proxy to take the addresses from; put the manifest into {} yourself",
            args.static_pod_dir.display()
        )));
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| failed(format!("runtime: {e}")))?;

    // 1. The version that serves now.
    let running = runtime.block_on(running_version(&held, &args.ca_file))?;
    match &manifest.tag {
        Some(tag) if *tag == running => {}
        _ if args.allow_version_change => tracing::warn!(image = %manifest.image, running, "migrate-back: the manifest's version differs from the one serving (--allow-version-change)"),
        _ => return Err(bad(format!(
            "the manifest runs {} but the apiserver serving now is {running}: render kubeadm's manifest from the ClusterConfiguration of the version you run (kubeadm-config's kubernetesVersion), not an older copy; or pass --allow-version-change",
            manifest.image
        ))),
    }

    // 2. SO_REUSEPORT and root on every socket of the port, through a duplicate.
    for e in &held {
        let (pid, fd, inode) = find_holder(&[e.inode], None).map_err(|denied| {
            failed(format!(
                "no process found holding {} (inode {}){}",
                e.local,
                e.inode,
                if denied.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; the descriptors of {} processes could not be read: {}",
                        denied.len(),
                        PtraceContext::read().explain()
                    )
                }
            ))
        })?;
        let taken = sys::take_fd_of(pid, fd)
            .map_err(|err| failed(crate::migrate::explain_getfd(&err, pid, fd)))?;
        let stat = nix::sys::stat::fstat(taken.as_raw_fd())
            .map_err(|err| failed(format!("the taken descriptor: {err}")))?;
        if stat.st_ino != inode {
            return Err(failed(format!(
                "descriptor {fd} of process {pid} is not {} any more",
                e.local
            )));
        }
        socket2::SockRef::from(&taken)
            .set_reuse_port(true)
            .map_err(|err| failed(format!("SO_REUSEPORT on {}: {err}", e.local)))?;
        nix::unistd::fchown(
            taken.as_raw_fd(),
            Some(Uid::from_raw(0)),
            Some(Gid::from_raw(0)),
        )
        .map_err(|err| failed(format!("giving {} to root: {err}", e.local)))?;
        drop(taken);
        tracing::info!(listen.addr = %e.local, pid, fd, was_uid = stat.st_uid, "migrate-back: SO_REUSEPORT set and the socket given to root (it stays with its process)");
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
        .ok_or_else(|| failed("no free address in 127.0.0.0/24 to reach the static apiserver"))?;
    let (listener, path) = runtime
        .block_on(async {
            bind_handoff_as(&args.handoff_dir, args.uid, args.gid.unwrap_or(args.uid))
        })
        .map_err(|e| failed(format!("--handoff-dir: {e}")))?;
    crate::fsutil::write_atomic(&target, text.as_bytes())
        .map_err(|e| failed(format!("cannot write {}: {e}", target.display())))?;
    let _ = std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600));
    tracing::info!(manifest = %target.display(), image = %manifest.image, "migrate-back: kubeadm's manifest is in place; the kubelet starts the static apiserver beside the proxies");

    // 4. Wait for it, then for the proxies' sockets.
    let result = runtime.block_on(serve(args, listener, direct, port));
    let _ = std::fs::remove_file(&path);
    if let Err(e) = &result {
        if matches!(e, Gave::Up(0, _)) {
            let _ = std::fs::remove_file(&target);
            tracing::warn!(manifest = %target.display(), "migrate-back: no socket was handed over; the manifest is removed again (the Deployment keeps serving)");
        }
    }
    result.map_err(|e| failed(e.to_string()))
}

/// The `gitVersion` the apiserver behind one of `held` reports.
async fn running_version(held: &[served::TcpEntry], ca: &Path) -> Result<String, MigrateError> {
    let mut errors = Vec::new();
    for e in held {
        let addr = SocketAddr::new(served::canonical(e.local.ip()), e.local.port());
        let api = ApiClient::anonymous(addr, ca, "kubernetes")
            .map_err(|err| bad(format!("--ca-file {}: {err}", ca.display())))?;
        match api.get_json("/version").await {
            Ok(v) => {
                if let Some(version) = v["gitVersion"].as_str() {
                    return Ok(version.to_owned());
                }
                errors.push(format!("{addr}: no gitVersion"));
            }
            Err(err) => errors.push(format!("{addr}: {err}")),
        }
    }
    Err(failed(format!(
        "cannot read the running apiserver's /version: {}",
        errors.join("; ")
    )))
}

/// Binds `<dir>/kap-<pid>-<n>.sock` listening as `uid`/`gid` (renamed into place once
/// listening, as proxy instances do), then takes root back.
fn bind_handoff_as(dir: &Path, uid: u32, gid: u32) -> std::io::Result<(UnixListener, PathBuf)> {
    let name = format!("kap-{}-{}.sock", std::process::id(), rand::random::<u32>());
    let path = dir.join(&name);
    let tmp = dir.join(format!(".{name}.tmp"));
    let _ = std::fs::remove_file(&tmp);
    nix::unistd::setegid(Gid::from_raw(gid))?;
    nix::unistd::seteuid(Uid::from_raw(uid))?;
    let bound = std::os::unix::net::UnixListener::bind(&tmp).and_then(|l| {
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
        l.set_nonblocking(true)?;
        std::fs::rename(&tmp, &path)?;
        Ok(l)
    });
    nix::unistd::seteuid(Uid::from_raw(0))?;
    nix::unistd::setegid(Gid::from_raw(0))?;
    Ok((UnixListener::from_std(bound?)?, path))
}

/// A network device that carries no traffic, for `SO_BINDTODEVICE`: a dummy, else one end of
/// a veth pair (both down); removed when dropped.
struct Sink(String);

impl Sink {
    fn create() -> std::io::Result<Self> {
        let name = format!("kapmb{}", std::process::id() % 100_000);
        let ip = |args: &[&str]| {
            std::process::Command::new("ip")
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        let peer = format!("{name}p");
        if ip(&["link", "add", &name, "type", "dummy"])
            || ip(&["link", "add", &name, "type", "veth", "peer", "name", &peer])
        {
            return Ok(Sink(name));
        }
        Err(std::io::Error::other(
            "`ip link add` of a dummy or veth device failed",
        ))
    }
}

impl Drop for Sink {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &self.0])
            .status();
    }
}

/// How the wait ended without success: sockets handed over so far, and why.
#[derive(Debug, thiserror::Error)]
enum Gave {
    #[error("{1}")]
    Up(usize, String),
}

/// Serves the handoff socket until nothing but the wildcard socket listens on `port`.
async fn serve(
    args: &MigrateBackArgs,
    listener: UnixListener,
    direct: SocketAddr,
    port: u16,
) -> Result<(), Gave> {
    let api =
        ApiClient::anonymous(direct, &args.ca_file, "kubernetes").map_err(|e| Gave::Up(0, e))?;
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
    let deadline = tokio::time::Instant::now() + args.timeout;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Gave::Up(0, e.to_string()))?;
    let forwards = TaskTracker::new();
    let mut ready = false;
    let mut taken = 0usize;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tracing::info!(timeout = ?args.timeout, direct = %direct, "migrate-back: waiting for the static apiserver to be ready");
    loop {
        tokio::select! {
            r = listener.accept() => {
                let Ok((stream, _)) = r else { continue };
                let answered = tokio::time::timeout(
                    EXCHANGE_TIMEOUT,
                    answer(args.uid, stream, ready, port, direct, &forwards, sink.as_ref()),
                )
                .await;
                match answered {
                    Ok(n) => taken += n,
                    Err(_) => tracing::warn!("migrate-back: peer too slow; connection closed"),
                }
            }
            _ = tick.tick() => {
                if !ready && api.get("/readyz").await.is_ok() {
                    ready = true;
                    tracing::info!(direct = %direct, "migrate-back: the static apiserver is ready; delete the Deployment now (kubectl -n kube-system delete deployment kube-apiserver): its proxy hands its sockets over here as it drains");
                }
                let left: Vec<SocketAddr> = listening(port)
                    .iter()
                    .filter(|e| !e.local.ip().is_unspecified())
                    .map(|e| e.local)
                    .collect();
                if ready && left.is_empty() && taken > 0 {
                    forwards.close();
                    if tokio::time::timeout(args.drain_timeout, forwards.wait()).await.is_err() {
                        tracing::warn!("migrate-back: forwarded connections still open at --drain-timeout; closed");
                    }
                    tracing::info!(sockets = taken, "migrate-back: done: only kubeadm's apiserver listens on the port");
                    return Ok(());
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Gave::Up(taken, format!(
                        "gave up after {:?}: {}; still listening: {left:?}",
                        args.timeout,
                        if ready { "the Deployment's sockets were not all handed over" } else { "the static apiserver never got ready" }
                    )));
                }
            }
            _ = term.recv() => return Err(Gave::Up(taken, "terminated".into())),
            _ = tokio::signal::ctrl_c() => return Err(Gave::Up(taken, "interrupted".into())),
        }
    }
}

/// Answers one peer; returns the number of listening sockets taken over.
async fn answer(
    uid: u32,
    stream: UnixStream,
    ready: bool,
    port: u16,
    direct: SocketAddr,
    forwards: &TaskTracker,
    sink: Option<&Sink>,
) -> usize {
    let cred = match sys::peer_credentials(stream.as_fd()) {
        Ok(c) if c.uid() == uid => c,
        Ok(c) => {
            tracing::warn!(
                peer.pid = c.pid(),
                peer.uid = c.uid(),
                "migrate-back: peer uid not allowed; refused"
            );
            return 0;
        }
        Err(e) => {
            tracing::warn!(error = %e, "migrate-back: cannot read peer credentials; refused");
            return 0;
        }
    };
    let (request, fds) = match wire::recv(&stream).await {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(peer.pid = cred.pid(), error = %e, "migrate-back: bad message rejected");
            return 0;
        }
    };
    let reply = match request {
        Message::StatusRequest => Message::Status {
            pid: std::process::id(),
            state: "MigratingBack".into(),
            ready,
        },
        Message::Adopt { addrs } if ready => {
            return adopt(
                &stream,
                &addrs,
                fds,
                port,
                direct,
                forwards,
                sink,
                cred.pid(),
            )
            .await
        }
        Message::Adopt { .. } => Message::Refuse {
            reason: "the static apiserver is not ready yet".into(),
        },
        _ => Message::Refuse {
            reason: "migrating back: only status requests and adoptions are answered".into(),
        },
    };
    let _ = wire::send(&stream, &reply, &[]).await;
    0
}

/// Takes a draining proxy's listening sockets and closes them with nothing refused or reset:
/// new connections turned away from them first (bound to `sink`, or else dropped by a filter),
/// then acknowledged, their queue accepted and forwarded, then closed.
#[allow(clippy::too_many_arguments)]
async fn adopt(
    stream: &UnixStream,
    addrs: &[String],
    fds: Vec<OwnedFd>,
    port: u16,
    direct: SocketAddr,
    forwards: &TaskTracker,
    sink: Option<&Sink>,
    pid: i32,
) -> usize {
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
            Err(e) => tracing::warn!(listen.addr = %addr, error = %e, "migrate-back: no SO_COOKIE"),
        }
    }
    if sink.is_none() {
        // The handshakes under way when the filter went on complete now and the proxy, still
        // accepting until our answer, takes them.
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let cookies = kept.iter().map(|(_, c, _)| *c).collect();
    if let Err(e) = wire::send(stream, &Message::Ack { cookies }, &[]).await {
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
    fn kubeadms_manifest_is_read_and_checked() {
        let m = parse_manifest(KUBEADM).unwrap();
        assert_eq!(m.image, "registry.k8s.io/kube-apiserver:v1.37.2");
        assert_eq!(m.tag.as_deref(), Some("v1.37.2"));
        assert_eq!(m.port, 6443);
        let no_sharing = KUBEADM.replace("    - --permit-port-sharing=true\n", "");
        assert!(parse_manifest(&no_sharing)
            .unwrap_err()
            .contains("--permit-port-sharing=true"));
        let bound = KUBEADM.replace("--secure-port=6443", "--bind-address=192.0.2.10");
        assert!(parse_manifest(&bound)
            .unwrap_err()
            .contains("--bind-address"));
        let port = KUBEADM.replace("--secure-port=6443", "--secure-port=8443");
        assert_eq!(parse_manifest(&port).unwrap().port, 8443);
        let digest = KUBEADM.replace(":v1.37.2", "@sha256:ab");
        assert_eq!(parse_manifest(&digest).unwrap().tag, None);
        assert!(parse_manifest("kind: Pod\n").is_err());
    }
}
