//! `kube-apiserver-proxy migrate`: a root process holding a wildcard listener
//! without `SO_REUSEPORT` (kubeadm's static kube-apiserver on 0.0.0.0:6443) keeps serving while
//! the node address and 127.0.0.1 move to a proxy running as another uid; no connection to
//! either is refused, before, during or after the holder exits, nor across a later handoff
//! between two proxies. Runs in a private network namespace (root).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::process::{bad_input_line, ChildProcess};
use kube_apiserver_proxy_tests::proxy::{proxy_bin, run_cli};
use kube_apiserver_proxy_tests::util::{
    connection_refused, eventually, free_random_loopback_addr, is_root, skip, TempDir,
};
use nix::sys::signal::Signal;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::launch::fake_apiserver_bin;
use crate::{echo_backend, serving, tcp_proxy, DEADLINE};

/// The proxy's uid in the manifests (the image's `nonroot`).
const PROXY_UID: u32 = 59443;

/// What the prober saw on one address.
#[derive(Debug, Default, Clone)]
struct Seen {
    ok: u64,
    refused: u64,
    errors: Vec<String>,
}

/// Connects to every address in turn, every few milliseconds, and makes one echo round trip on
/// each connection: counts successes, refusals and any other failure.
struct Prober {
    stop: Arc<AtomicBool>,
    seen: Arc<Mutex<Vec<(SocketAddr, Seen)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Prober {
    fn start(addrs: &[SocketAddr]) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(
            addrs
                .iter()
                .map(|a| (*a, Seen::default()))
                .collect::<Vec<_>>(),
        ));
        let (s, st, addrs) = (seen.clone(), stop.clone(), addrs.to_vec());
        let task = tokio::spawn(async move {
            while !st.load(Ordering::SeqCst) {
                for (i, addr) in addrs.iter().enumerate() {
                    let result = round_trip(*addr).await;
                    let mut seen = s.lock().unwrap();
                    let entry = &mut seen[i].1;
                    match result {
                        Ok(()) => entry.ok += 1,
                        Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                            entry.refused += 1
                        }
                        Err(e) => entry.errors.push(e.to_string()),
                    }
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        Self { stop, seen, task }
    }

    fn ok_total(&self) -> u64 {
        self.seen.lock().unwrap().iter().map(|(_, s)| s.ok).sum()
    }

    /// Waits until every address had `n` more successful round trips than now.
    async fn advance(&self, n: u64) -> Result<()> {
        let start: Vec<u64> = self
            .seen
            .lock()
            .unwrap()
            .iter()
            .map(|(_, s)| s.ok)
            .collect();
        eventually(DEADLINE, || async {
            let seen = self.seen.lock().unwrap().clone();
            for ((addr, s), before) in seen.iter().zip(&start) {
                ensure!(s.ok >= before + n, "{addr}: {s:?}");
            }
            Ok(())
        })
        .await
    }

    async fn stop(self) -> Vec<(SocketAddr, Seen)> {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.task.await;
        self.seen.lock().unwrap().clone()
    }
}

async fn round_trip(addr: SocketAddr) -> std::io::Result<()> {
    let limit = Duration::from_secs(5);
    let timeout = |_| std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
    let mut s = tokio::time::timeout(limit, tokio::net::TcpStream::connect(addr))
        .await
        .map_err(timeout)??;
    s.write_all(b"ping").await?;
    let mut buf = [0u8; 4];
    tokio::time::timeout(limit, s.read_exact(&mut buf))
        .await
        .map_err(timeout)??;
    if &buf != b"ping" {
        return Err(std::io::Error::other(format!("echo answered {buf:?}")));
    }
    Ok(())
}

/// A handoff directory as the node prepares it: owned by the proxy's uid, mode 0700.
fn handoff_dir(tmp: &TempDir) -> Result<std::path::PathBuf> {
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755))?;
    let dir = tmp.join("handoff");
    std::fs::create_dir(&dir)?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
    let id = Some(nix::unistd::Uid::from_raw(PROXY_UID));
    nix::unistd::chown(&dir, id, Some(nix::unistd::Gid::from_raw(PROXY_UID)))?;
    Ok(dir)
}

/// `migrate` with these `--listen` addresses; the kubeconfigs it reads are in `dir/kubernetes`
/// (none unless the test writes some), never the host's `/etc/kubernetes`.
fn migrate_command(listen: &[SocketAddr], dir: &Path) -> Result<Command> {
    let kubernetes = dir
        .parent()
        .context("handoff dir's parent")?
        .join("kubernetes");
    std::fs::create_dir_all(&kubernetes)?;
    let mut cmd = Command::new(proxy_bin()?);
    cmd.arg("migrate");
    for addr in listen {
        cmd.arg("--listen").arg(addr.to_string());
    }
    cmd.arg("--handoff-dir")
        .arg(dir)
        .args(["--timeout", "60s"])
        .arg("--kubernetes-dir")
        .arg(kubernetes);
    Ok(cmd)
}

/// "kubeadm's apiserver": root, no SO_REUSEPORT, on `listen` (a wildcard), ready.
async fn wildcard_holder(listen: &str, run_as: Option<u32>) -> Result<ChildProcess> {
    let mut cmd = match run_as {
        Some(uid) => {
            let mut c = Command::new("setpriv");
            c.arg(format!("--reuid={uid}"))
                .arg(format!("--regid={uid}"))
                .arg("--clear-groups")
                .arg(fake_apiserver_bin());
            c
        }
        None => Command::new(fake_apiserver_bin()),
    };
    cmd.args(["--mode", "echo", "--listen", listen]);
    let holder = ChildProcess::spawn(cmd, "wildcard holder")?;
    eventually(DEADLINE, || async {
        holder.ensure_running()?;
        ensure!(holder.stdout().contains("listening on"), "not yet");
        Ok(())
    })
    .await?;
    Ok(holder)
}

/// Whether a root socket with SO_REUSEPORT can bind beside the holder's wildcard socket, i.e.
/// whether SO_REUSEPORT was set on it.
fn reuseport_set_on_the_wildcard(addr: SocketAddr) -> bool {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        None,
    )
    .expect("socket");
    s.set_reuse_port(true).expect("SO_REUSEPORT");
    s.bind(&addr.into()).is_ok()
}

#[test]
fn moves_the_addresses_off_a_wildcard_listener_without_refusing() -> Result<()> {
    crate::handoff::run_in_netns("migrate::inner_moves_the_addresses_off_a_wildcard_listener")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through moves_the_addresses_off_a_wildcard_listener_without_refusing"]
async fn inner_moves_the_addresses_off_a_wildcard_listener() -> Result<()> {
    crate::handoff::inner_setup()?;
    // Any free port (6443 in a cluster).
    let port = free_random_loopback_addr()?.port();
    // The node address: any address of the namespace other than 127.0.0.1 will do.
    let node = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 1, 1, 1)), port);
    let local = SocketAddr::from(([127, 0, 0, 1], port));
    let elsewhere = SocketAddr::from(([127, 0, 0, 2], port));

    // "kubeadm's apiserver": root, 0.0.0.0:PORT, no SO_REUSEPORT.
    let mut cmd = Command::new(fake_apiserver_bin());
    cmd.args(["--mode", "echo", "--listen"])
        .arg(format!("0.0.0.0:{port}"));
    let holder = ChildProcess::spawn(cmd, "wildcard holder")?;
    eventually(DEADLINE, || async {
        holder.ensure_running()?;
        ensure!(holder.stdout().contains("listening on"), "not yet");
        Ok(())
    })
    .await?;
    let backend = echo_backend().await?;
    let tmp = TempDir::new("migrate")?;
    let dir = handoff_dir(&tmp)?;

    // The obstacle: while the holder listens, a proxy of another uid cannot bind the node
    // address (it exits with EADDRINUSE).
    let blocked = tcp_proxy(node, &[&backend])
        .fast_health()
        .run_as(PROXY_UID)
        .spawn()
        .await?;
    let status = blocked.wait_exit(DEADLINE).await?;
    ensure!(
        !status.success() && blocked.stderr().contains("in use"),
        "a proxy bound beside the wildcard listener: {status}, {}",
        blocked.stderr()
    );

    let prober = Prober::start(&[node, local]);
    prober.advance(20).await?;

    let migrate = ChildProcess::spawn(migrate_command(&[node, local], &dir)?, "migrate")?;
    eventually(DEADLINE, || async {
        migrate.ensure_running()?;
        ensure!(migrate.stderr().contains("waiting for a proxy"), "not yet");
        Ok(())
    })
    .await?;
    // Bound, not listening: the holder still gets every connection meanwhile.
    prober.advance(20).await?;

    let first = serving(
        tcp_proxy(node, &[&backend])
            .listen(local)
            .fast_health()
            .arg("--handoff-dir")
            .arg(&dir)
            .run_as(PROXY_UID),
    )
    .await?;
    let status = migrate.wait_exit(DEADLINE).await?;
    ensure!(
        status.success() && migrate.stderr().contains("handed to the proxy"),
        "migrate: {status}: {}",
        migrate.stderr()
    );
    ensure!(
        first.stderr().contains("sockets shared by peer"),
        "the proxy did not take shared sockets: {}",
        first.stderr()
    );
    // New connections to both addresses now reach the proxy.
    let before = first
        .metric_or_zero("kube_apiserver_proxy_connections_accepted_total", &[])
        .await?;
    prober.advance(20).await?;
    let after = first
        .metric_or_zero("kube_apiserver_proxy_connections_accepted_total", &[])
        .await?;
    ensure!(
        after >= before + 40.0,
        "the proxy accepted {before} then {after}"
    );

    // The holder goes (the static pod's removal): its wildcard socket closes with it.
    holder.signal(Signal::SIGTERM)?;
    holder.wait_exit(DEADLINE).await?;
    eventually(DEADLINE, || async {
        ensure!(
            connection_refused(elsewhere).await,
            "{elsewhere} still accepted"
        );
        Ok(())
    })
    .await?;
    prober.advance(20).await?;

    // A later rollout: a successor of the proxy's uid shares the sockets (created under the
    // holder's uid) and the first one hands them over at SIGTERM.
    let second = serving(
        tcp_proxy(node, &[&backend])
            .listen(local)
            .fast_health()
            .arg("--handoff-dir")
            .arg(&dir)
            .run_as(PROXY_UID),
    )
    .await?;
    prober.advance(20).await?;
    first.sigterm()?;
    first.wait_exit(Duration::from_secs(30)).await?;
    prober.advance(20).await?;
    second.ensure_running()?;

    let total = prober.ok_total();
    let seen = prober.stop().await;
    for (addr, s) in &seen {
        ensure!(
            s.refused == 0 && s.errors.is_empty(),
            "{addr}: {} refused, errors {:?} ({} ok)",
            s.refused,
            s.errors,
            s.ok
        );
    }
    println!("migrate: {total} round trips, none refused: {seen:?}");
    Ok(())
}

/// Bad input: one line, exit 2, nothing looked at or bound.
#[tokio::test]
async fn migrate_rejects_bad_input() -> Result<()> {
    if !is_root() {
        return skip(
            "migrate_rejects_bad_input",
            "the root check comes before some of the checks",
        );
    }
    let tmp = TempDir::new("migrate-bad")?;
    for (args, expect) in [
        (vec!["--listen", "0.0.0.0:6443"], "wildcard"),
        (
            vec!["--listen", "127.0.0.1:6443", "--listen", "127.1.1.1:6444"],
            "same port",
        ),
        (vec!["--listen", "127.0.0.1:6443", "--uid", "0"], "--uid 0"),
        (
            vec![
                "--listen",
                "127.0.0.1:6443",
                "--handoff-dir",
                "/nonexistent/x",
            ],
            "--handoff-dir",
        ),
        (
            vec![
                "--listen",
                "127.0.0.1:6443",
                "--handoff-dir",
                tmp.path().to_str().unwrap(),
            ],
            "must belong to uid 59443",
        ),
        (vec!["--timeout", "1s"], "--listen"),
    ] {
        let mut argv = vec!["migrate"];
        argv.extend(args.iter().copied());
        let out = run_cli(&argv).await?;
        let line = bad_input_line(&out, &format!("{argv:?}"))?;
        ensure!(line.contains(expect), "{argv:?}: {line}");
    }
    Ok(())
}

/// The launch side of a migration, with a real process: while a wildcard listener holds the
/// port, `launch` gives the command another port through `{{port}}` and writes it to the
/// address file.
#[tokio::test]
async fn launch_moves_the_port_while_a_wildcard_listener_holds_it() -> Result<()> {
    let wildcard = std::net::TcpListener::bind("0.0.0.0:0")?;
    let port = wildcard.local_addr()?.port();
    let tmp = TempDir::new("launch-wildcard")?;
    let file = tmp.join("address");
    let out = run_cli(&[
        "launch".as_ref(),
        "--address-file".as_ref(),
        file.as_os_str(),
        "--port".as_ref(),
        port.to_string().as_ref(),
        "--".as_ref(),
        "echo".as_ref(),
        "--bind-address={{address}}".as_ref(),
        "--secure-port={{port}}".as_ref(),
    ] as &[&std::ffi::OsStr])
    .await?;
    ensure!(out.status.success(), "{out:?}");
    let written: SocketAddr = std::fs::read_to_string(&file)?
        .trim()
        .parse()
        .context("address file")?;
    ensure!(written.port() != port, "{written} is on the held port");
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(
        stdout.trim()
            == format!(
                "--bind-address={} --secure-port={}",
                written.ip(),
                written.port()
            ),
        "{stdout}"
    );
    // Without {{port}}: one line naming the cause, exit 2.
    let out = run_cli(&[
        "launch".as_ref(),
        "--address-file".as_ref(),
        file.as_os_str(),
        "--port".as_ref(),
        port.to_string().as_ref(),
        "--".as_ref(),
        "echo".as_ref(),
        "--bind-address={{address}}".as_ref(),
    ] as &[&std::ffi::OsStr])
    .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2) && stderr.contains("wildcard listener"),
        "{out:?}"
    );
    drop(wildcard);
    Ok(())
}

#[test]
fn refuses_to_leave_an_address_in_use_behind() -> Result<()> {
    crate::handoff::run_in_netns("migrate::inner_refuses_to_leave_an_address_in_use_behind")
}

/// A VIP named by `kube-public/cluster-info` (`controlPlaneEndpoint`), a second address named by
/// a kubeconfig, and `[::1]` with an established client: `migrate --listen NODE --listen
/// 127.0.0.1` refuses with one line naming the three (exit 2) and changes nothing; once each is
/// moved or dropped on purpose, it proceeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through refuses_to_leave_an_address_in_use_behind"]
async fn inner_refuses_to_leave_an_address_in_use_behind() -> Result<()> {
    crate::handoff::inner_setup()?;
    let port = free_random_loopback_addr()?.port();
    let node = SocketAddr::from(([127, 1, 1, 1], port));
    let local = SocketAddr::from(([127, 0, 0, 1], port));
    let vip = SocketAddr::from(([127, 4, 4, 4], port));
    let second = SocketAddr::from(([127, 2, 2, 2], port));
    let v6 = kube_apiserver_proxy_tests::util::ipv6_loopback_available();
    // Go's kube-apiserver on 0.0.0.0 listens dual-stack, [::]:PORT.
    let holder = wildcard_holder(
        &format!("{}:{port}", if v6 { "[::]" } else { "0.0.0.0" }),
        None,
    )
    .await?;
    let tmp = TempDir::new("migrate-served")?;
    let dir = handoff_dir(&tmp)?;
    let kubernetes = tmp.join("kubernetes");
    std::fs::create_dir(&kubernetes)?;

    // kube-public/cluster-info names the VIP; admin.conf reaches the apiserver that serves it.
    let pki = Pki::new()?;
    let api_ip = kube_apiserver_proxy_tests::util::random_loopback_ip()?;
    let serving = pki.ca.server_cert(&["kubernetes", &api_ip.to_string()])?;
    let api = FakeApiserver::https_with_identity(serving.cert_chain(), serving.private_key())
        .bind(SocketAddr::new(api_ip, 0))
        .require_client_cert(pki.ca.root_store()?)
        .object(
            "/api/v1/namespaces/kube-public/configmaps/cluster-info",
            &serde_json::json!({"kind": "ConfigMap", "data": {"kubeconfig": format!(
                "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: x\n    server: https://{vip}\n  name: \"\"\n")}}),
        )
        .start()
        .await?;
    let conf = |server: SocketAddr| {
        format!(
            "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority: {}\n    server: https://{server}\n  name: c\nusers:\n- name: u\n  user:\n    client-certificate: {}\n    client-key: {}\n",
            pki.ca_file().display(),
            pki.client_cert_file().display(),
            pki.client_key_file().display()
        )
    };
    std::fs::write(kubernetes.join("admin.conf"), conf(api.addr()))?;
    std::fs::write(kubernetes.join("scheduler.conf"), conf(second))?;
    std::fs::write(kubernetes.join("kubelet.conf"), conf(node))?;
    // A client of [::1] that stays connected (the node's own kubectl, say).
    let _client = if v6 {
        Some(
            tokio::net::TcpStream::connect(SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)))
                .await?,
        )
    } else {
        None
    };

    let run = |extra: &[String]| -> Result<Command> {
        let mut cmd = migrate_command(&[node, local], &dir)?;
        cmd.args(extra);
        Ok(cmd)
    };
    let refused = ChildProcess::spawn(run(&[])?, "migrate")?;
    let status = refused.wait_exit(DEADLINE).await?;
    let stderr = refused.stderr();
    let last = stderr.lines().last().unwrap_or("");
    ensure!(status.code() == Some(2), "migrate: {status}: {stderr}");
    ensure!(
        last.starts_with("error: migrate: these addresses of this node serve port")
            && last.contains(&format!("{vip} (server {vip} in kube-public/cluster-info)"))
            && last.contains(&format!(
                "{second} (server {second} in {}",
                kubernetes.join("scheduler.conf").display()
            ))
            && (!v6 || last.contains(&format!("[::1]:{port} (1 established connection)")))
            && !last.contains(&node.to_string())
            && !last.contains(&local.to_string()),
        "{stderr}"
    );
    // Nothing was touched: the wildcard socket still refuses company.
    ensure!(
        !reuseport_set_on_the_wildcard(node),
        "SO_REUSEPORT was set on the holder's socket"
    );
    ensure!(
        std::fs::read_dir(&dir)?.next().is_none(),
        "something in the handoff directory"
    );

    // Moved (the second address) or dropped (the VIP, [::1]) on purpose: it goes ahead.
    let mut extra = vec![
        "--listen".to_owned(),
        second.to_string(),
        "--drop".to_owned(),
        vip.ip().to_string(),
    ];
    if v6 {
        extra.extend(["--drop".to_owned(), "[::1]".to_owned()]);
    }
    let going = ChildProcess::spawn(run(&extra)?, "migrate")?;
    eventually(DEADLINE, || async {
        going.ensure_running()?;
        ensure!(
            going.stderr().contains("waiting for a proxy"),
            "not yet: {}",
            going.stderr()
        );
        Ok(())
    })
    .await?;
    going.signal(Signal::SIGTERM)?;
    let status = going.wait_exit(DEADLINE).await?;
    ensure!(
        status.code() == Some(1) && going.stderr().contains("nothing was handed over"),
        "{status}: {}",
        going.stderr()
    );
    drop(holder);
    Ok(())
}

#[test]
fn a_denied_ptrace_says_what_denies_it() -> Result<()> {
    crate::handoff::run_in_netns("migrate::inner_a_denied_ptrace_says_what_denies_it")
}

/// `migrate` without `CAP_SYS_PTRACE` (dropped from its bounding set: a container that runs it
/// as root) cannot reach the apiserver's descriptors of another uid; the error says that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through a_denied_ptrace_says_what_denies_it"]
async fn inner_a_denied_ptrace_says_what_denies_it() -> Result<()> {
    crate::handoff::inner_setup()?;
    let port = free_random_loopback_addr()?.port();
    let holder = wildcard_holder(&format!("0.0.0.0:{port}"), Some(65534)).await?;
    let tmp = TempDir::new("migrate-ptrace")?;
    let dir = handoff_dir(&tmp)?;
    let inner = migrate_command(&[SocketAddr::from(([127, 1, 1, 1], port))], &dir)?;
    let mut cmd = Command::new("setpriv");
    cmd.args(["--inh-caps=-sys_ptrace", "--bounding-set=-sys_ptrace", "--"])
        .arg(inner.get_program())
        .args(inner.get_args());
    let out = cmd.output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1), "{:?}: {stderr}", out.status);
    ensure!(
        stderr.contains("could not be read")
            && stderr.contains("this process lacks CAP_SYS_PTRACE"),
        "{stderr}"
    );
    drop(holder);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// migrate-back: from the Deployment back to kubeadm's static apiserver
// ---------------------------------------------------------------------------------------------

/// What the HTTPS prober saw on one address: successes, refusals, other errors, slowest.
#[derive(Debug, Default, Clone)]
struct HttpsSeen {
    ok: u64,
    refused: u64,
    errors: Vec<String>,
    slowest: Duration,
}

/// `GET /readyz` over a fresh TLS connection to every address in turn, until stopped: an
/// answer (whatever its status) is a success, a refused connect or any other error is not.
fn https_prober(
    client: Arc<kube_apiserver_proxy_tests::client::HttpsClient>,
    addrs: Vec<SocketAddr>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(SocketAddr, HttpsSeen)>> {
    tokio::spawn(async move {
        let mut seen: Vec<(SocketAddr, HttpsSeen)> =
            addrs.iter().map(|a| (*a, HttpsSeen::default())).collect();
        while !stop.load(Ordering::SeqCst) {
            for (addr, s) in seen.iter_mut() {
                let t = std::time::Instant::now();
                // Any answer counts: an apiserver that is stopping answers /readyz with 503.
                match client.get(*addr, "/readyz").await {
                    Ok(_) => s.ok += 1,
                    Err(e) if format!("{e:#}").contains("Connection refused") => s.refused += 1,
                    Err(e) => s.errors.push(format!("{e:#}")),
                }
                s.slowest = s.slowest.max(t.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        seen
    })
}

#[test]
fn migrate_back_hands_the_addresses_to_a_static_apiserver_without_refusing() -> Result<()> {
    crate::handoff::run_in_netns(
        "migrate::inner_migrate_back_hands_the_addresses_to_a_static_apiserver",
    )?;
    // No device to turn new connections away with (its name taken): the SYN filter instead.
    crate::handoff::run_in_netns("migrate::inner_migrate_back_without_a_device")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through migrate_back_hands_the_addresses_to_a_static_apiserver_without_refusing"]
async fn inner_migrate_back_without_a_device() -> Result<()> {
    migrate_back_rehearsal(false).await
}

/// The Deployment (its proxy, as the proxies' uid, on the node address and 127.0.0.1; its
/// apiserver on a random 127.a.b.c) goes, kubeadm's static apiserver (root, `0.0.0.0`,
/// `--permit-port-sharing`)
/// comes: it can bind only after `migrate-back` prepared the sockets, the draining proxy hands
/// its sockets to `migrate-back`, which closes them with nothing reset, and not one request of
/// an HTTPS prober on both addresses fails or is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through migrate_back_hands_the_addresses_to_a_static_apiserver_without_refusing"]
async fn inner_migrate_back_hands_the_addresses_to_a_static_apiserver() -> Result<()> {
    migrate_back_rehearsal(true).await
}

/// The rehearsal above; `with_device`: the taken sockets are bound to a device that carries no
/// traffic (made over rtnetlink), or, where none can be made, a SYN filter turns new
/// connections away.
async fn migrate_back_rehearsal(with_device: bool) -> Result<()> {
    crate::handoff::inner_setup()?;
    let pki = Pki::new()?;
    let port = free_random_loopback_addr()?.port();
    let node = SocketAddr::from(([127, 1, 1, 1], port));
    let local = SocketAddr::from(([127, 0, 0, 1], port));
    let tmp = TempDir::new("migrate-back")?;
    let dir = handoff_dir(&tmp)?;
    let manifests = tmp.join("manifests");
    std::fs::create_dir(&manifests)?;
    let fake = |listen: String, extra: &[&str]| -> Result<ChildProcess> {
        let mut cmd = Command::new(fake_apiserver_bin());
        cmd.args(["--listen", &listen, "--cert"])
            .arg(pki.server_cert_file())
            .arg("--key")
            .arg(pki.server_key_file())
            .args(extra);
        ChildProcess::spawn(cmd, "fake apiserver")
    };
    let started = |p: &ChildProcess| {
        let out = p.stdout();
        out.contains("listening on")
    };

    // The Deployment's pod: its apiserver (root, no SO_REUSEPORT; kube-apiserver's shutdown
    // delay keeps serving after SIGTERM) and its proxy.
    let own = SocketAddr::new(
        kube_apiserver_proxy_tests::util::random_loopback_ip()?,
        port,
    );
    let deployment_apiserver = fake(own.to_string(), &["--shutdown-delay-duration=3s"])?;
    eventually(DEADLINE, || async {
        deployment_apiserver.ensure_running()?;
        ensure!(started(&deployment_apiserver), "not yet");
        Ok(())
    })
    .await?;
    let proxy = serving(
        kube_apiserver_proxy_tests::proxy::ProxyBuilder::new()
            .listen(node)
            .listen(local)
            .backend(own)
            .health_check("tcp")
            .fast_health()
            .drain_timeout(Duration::from_secs(10))
            .arg("--handoff-dir")
            .arg(&dir)
            .run_as(PROXY_UID),
    )
    .await?;

    let client = Arc::new(kube_apiserver_proxy_tests::client::HttpsClient::new(
        pki.client_config(false)?,
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let prober = https_prober(client.clone(), vec![node, local], stop.clone());

    // Without migrate-back, kubeadm's apiserver cannot bind beside them.
    let blocked = fake(format!("0.0.0.0:{port}"), &["--permit-port-sharing=true"])?;
    let status = blocked.wait_exit(DEADLINE).await?;
    ensure!(
        !status.success() && blocked.stderr().contains("in use"),
        "kubeadm's apiserver bound beside the Deployment: {status} {}",
        blocked.stderr()
    );

    // kubeadm's manifest, of the version that serves (the fake's /version).
    let manifest = tmp.join("kube-apiserver.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: v1\nkind: Pod\nspec:\n  containers:\n  - command:\n    - kube-apiserver\n    - --secure-port=PORT\n    - --permit-port-sharing=true\n    image: registry.k8s.io/kube-apiserver:v1.31.0-fake\n"
            .replace("PORT", &port.to_string()),
    )?;
    let mut cmd = if with_device {
        Command::new(proxy_bin()?)
    } else {
        // A device of the name migrate-back gives its own (kapmbPID) is there already: it can
        // make none. The shell execs migrate-back, which keeps its pid.
        let mut sh = Command::new("sh");
        sh.arg("-c")
            .arg(r#"n=kapmb$(($$ % 100000)); ip link add "$n" type veth peer name "${n}x" && exec "$0" "$@""#)
            .arg(proxy_bin()?);
        sh
    };
    cmd.arg("migrate-back")
        .arg("--manifest")
        .arg(&manifest)
        .arg("--static-pod-dir")
        .arg(&manifests)
        .arg("--handoff-dir")
        .arg(&dir)
        .arg("--ca-file")
        .arg(pki.ca_file())
        .args(["--timeout", "60s"]);
    let back = ChildProcess::spawn(cmd, "migrate-back")?;

    // The kubelet: starts the static pod once its manifest appears.
    let placed = manifests.join("kube-apiserver.yaml");
    eventually(DEADLINE, || async {
        back.ensure_running()?;
        ensure!(placed.exists(), "no manifest yet: {}", back.stderr());
        Ok(())
    })
    .await?;
    // kubeadm's manifest with one line added: a UID of its content (going-back.md), which
    // keeps the pod through a move of the kubelet's directory or a kubelet upgrade.
    let (placed_text, given) = (
        std::fs::read_to_string(&placed)?,
        std::fs::read_to_string(&manifest)?,
    );
    let uid_line = placed_text
        .lines()
        .find(|l| l.starts_with("  uid: "))
        .with_context(|| format!("no uid: {placed_text}"))?;
    ensure!(
        placed_text.replace(&format!("metadata:\n{uid_line}\n"), "") == given
            && uid_line.len() == "  uid: ".len() + 32,
        "the installed manifest is not kubeadm's with a UID: {placed_text}"
    );
    let kubeadm = fake(format!("0.0.0.0:{port}"), &["--permit-port-sharing=true"])?;
    eventually(DEADLINE, || async {
        kubeadm.ensure_running()?;
        ensure!(started(&kubeadm), "not yet: {}", kubeadm.stderr());
        Ok(())
    })
    .await?;
    eventually(DEADLINE, || async {
        back.ensure_running()?;
        ensure!(
            back.stderr().contains("delete the Deployment now"),
            "not yet: {}",
            back.stderr()
        );
        Ok(())
    })
    .await?;

    // The Deployment is deleted: its proxy drains and hands its sockets over; its apiserver
    // stops after its shutdown delay.
    proxy.sigterm()?;
    deployment_apiserver.signal(Signal::SIGTERM)?;
    let status = back.wait_exit(Duration::from_secs(30)).await?;
    let turned_away = if with_device { "device" } else { "filter" };
    ensure!(
        status.success()
            && back.stderr().contains("closed with nothing reset")
            && back
                .stderr()
                .contains(&format!("turned_away=\"{turned_away}\"")),
        "migrate-back: {status}: {}",
        back.stderr()
    );
    ensure!(
        proxy.stderr().contains("listening sockets adopted by peer"),
        "the proxy did not hand over: {}",
        proxy.stderr()
    );
    proxy.wait_exit(Duration::from_secs(30)).await?;
    // kubeadm's apiserver alone serves both addresses now.
    for addr in [node, local] {
        let (status, _) = client.get(addr, "/readyz").await?;
        ensure!(status == 200, "{addr}: {status}");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    stop.store(true, Ordering::SeqCst);
    let seen = prober.await?;
    for (addr, s) in &seen {
        ensure!(
            s.refused == 0 && s.errors.is_empty() && s.ok > 20,
            "{addr}: {} ok, {} refused, errors {:?}",
            s.ok,
            s.refused,
            s.errors
        );
    }
    println!("migrate-back ({turned_away}): {seen:?}");
    drop(kubeadm);
    Ok(())
}
