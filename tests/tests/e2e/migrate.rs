//! `kube-apiserver-proxy migrate` (issue 13 point 2): a root process holding a wildcard listener
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
use kube_apiserver_proxy_tests::process::ChildProcess;
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

fn migrate_command(listen: &[SocketAddr], dir: &Path) -> Result<Command> {
    let mut cmd = Command::new(proxy_bin()?);
    cmd.arg("migrate");
    for addr in listen {
        cmd.arg("--listen").arg(addr.to_string());
    }
    cmd.arg("--handoff-dir").arg(dir).args(["--timeout", "60s"]);
    Ok(cmd)
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
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.code() == Some(2),
            "{argv:?}: {:?}: {stderr}",
            out.status
        );
        ensure!(
            stderr.trim().lines().count() == 1 && stderr.contains(expect),
            "{argv:?}: {stderr}"
        );
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
