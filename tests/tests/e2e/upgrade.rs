//! In-place upgrade (SIGUSR2, `systemctl reload`): the running instance starts the binary now
//! at its path with the same arguments, waits until it is ready, hands over and drains.
//!
//! The binary is run from a copy in a temporary directory, which the tests replace between the
//! start and the reload (with the same program plus trailing bytes, so the successor's
//! `/proc/<pid>/exe` tells which file it runs; or with a script that fails). Successors are
//! not children of the test: they are found through `/status` (its `pid`) on the admin address,
//! which the predecessor passes on, and killed by pid when the test ends.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use kube_apiserver_proxy_tests::client::{http_get, TcpClient};
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::load::Load;
use kube_apiserver_proxy_tests::proxy::{previous_release_bin, proxy_bin, Proxy, ProxyBuilder};
use kube_apiserver_proxy_tests::streams::Streams;
use kube_apiserver_proxy_tests::util::{
    eventually, free_random_loopback_addr, proof_count, skip, TempDir,
};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// Deadline for a successor to become ready and its predecessor to be gone.
pub const UPGRADE_DEADLINE: Duration = Duration::from_secs(30);

/// Kills a process that is not our child (a successor) when the test ends.
pub struct PidGuard(pub u32);

impl Drop for PidGuard {
    fn drop(&mut self) {
        if alive(self.0) {
            let _ = kill(Pid::from_raw(self.0 as i32), Signal::SIGKILL);
        }
    }
}

/// Whether `pid` is a live process (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z') && !rest.starts_with('X')),
        Err(_) => false,
    }
}

/// Copies the proxy binary to `path` (0755), with `marker` appended (an ELF runs the same with
/// trailing bytes), through a rename so a running process keeps its old file.
pub fn install_binary(path: &Path, marker: &str) -> Result<u64> {
    let mut bytes = std::fs::read(proxy_bin()?)?;
    bytes.extend_from_slice(marker.as_bytes());
    install_bytes(path, &bytes)
}

fn install_bytes(path: &Path, bytes: &[u8]) -> Result<u64> {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, bytes)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, path)?;
    Ok(bytes.len() as u64)
}

/// The instance answering on an admin address: its pid and whether it is ready.
pub async fn admin_pid(admin: SocketAddr) -> Result<(u32, bool)> {
    let (code, body) = http_get(admin, "/status").await?;
    ensure!(code == 200, "/status {code}");
    let status: serde_json::Value = serde_json::from_str(&body)?;
    let pid = status["pid"].as_u64().context("no pid in /status")? as u32;
    Ok((pid, status["ready"].as_bool() == Some(true)))
}

/// Listener cookies as `/status` on `admin` shows them (never empty).
pub async fn cookies_at(admin: SocketAddr) -> Result<Vec<u64>> {
    let (_, body) = http_get(admin, "/status").await?;
    let status: serde_json::Value = serde_json::from_str(&body)?;
    let mut cookies: Vec<u64> = status["listeners"]
        .as_array()
        .context("listeners")?
        .iter()
        .map(|l| l["cookie"].as_u64().context("cookie"))
        .collect::<Result<_>>()?;
    ensure!(!cookies.is_empty(), "no listener: {status}");
    cookies.sort();
    Ok(cookies)
}

/// Sends SIGUSR2 to `pid` and waits until another instance answers ready on `admin`; returns
/// its pid. The predecessor may still be draining.
pub async fn upgrade(pid: u32, admin: SocketAddr) -> Result<u32> {
    kill(Pid::from_raw(pid as i32), Signal::SIGUSR2).context("kill -USR2")?;
    eventually(UPGRADE_DEADLINE, || async {
        let (now, ready) = admin_pid(admin).await?;
        ensure!(
            now != pid && ready,
            "admin answers for pid {now} (ready {ready})"
        );
        Ok(now)
    })
    .await
}

/// Waits until `pid` is gone (it is not our child: its exit status is its new parent's).
pub async fn wait_gone(pid: u32) -> Result<()> {
    eventually(UPGRADE_DEADLINE, || async {
        ensure!(!alive(pid), "pid {pid} still running");
        Ok(())
    })
    .await
}

fn cmdline(pid: u32) -> Result<Vec<u8>> {
    Ok(std::fs::read(format!("/proc/{pid}/cmdline"))?)
}

/// One instance run from a replaceable copy of the binary, with a handoff directory.
pub struct Upgradable {
    pub dir: ReapingDir,
    pub bin: PathBuf,
    pub first: Proxy,
}

/// The directory of an upgradable instance's binary: when it goes, so does every process
/// still running a binary from it. Successors are not the test's children: one started by an
/// upgrade that the test gave up on before it knew the successor's pid (a failed assertion)
/// would otherwise live on, serving and holding its sockets, after the test.
pub struct ReapingDir(TempDir);

impl std::ops::Deref for ReapingDir {
    type Target = TempDir;
    fn deref(&self) -> &TempDir {
        &self.0
    }
}

impl Drop for ReapingDir {
    fn drop(&mut self) {
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return;
        };
        for e in entries.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else {
                continue;
            };
            if std::fs::read_link(e.path().join("exe"))
                .is_ok_and(|exe| exe.starts_with(self.0.path()))
            {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
    }
}

impl Upgradable {
    /// Starts the first instance; `customize` adds to its command line and environment (the
    /// drain timeout must be among them).
    pub async fn start(
        listen: SocketAddr,
        backend: SocketAddr,
        customize: impl FnOnce(ProxyBuilder) -> ProxyBuilder,
    ) -> Result<Self> {
        let dir = ReapingDir(TempDir::new("upgrade")?);
        std::fs::create_dir_all(dir.join("bin"))?;
        let bin = dir.join("bin").join("kube-apiserver-proxy");
        install_binary(&bin, "")?;
        let defaults = ProxyBuilder::new()
            .bin(&bin)
            .listen(listen)
            .backend(backend)
            .health_check("tcp")
            .fast_health()
            .arg("--handoff-dir")
            .arg(dir.join("handoff"));
        let first = customize(defaults).spawn().await?;
        eventually(Duration::from_secs(10), || async {
            first.ensure_running()?;
            let (code, _) = first.admin_get("/readyz").await?;
            ensure!(code == 200, "/readyz {code}");
            Ok(())
        })
        .await?;
        Ok(Upgradable { dir, bin, first })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_runs_the_replaced_binary_and_loses_nothing() -> Result<()> {
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let notify_dir = TempDir::new("notify")?;
    let notify_path = notify_dir.join("notify");
    let notify = UnixDatagram::bind(&notify_path)?;
    notify.set_nonblocking(true)?;
    let Upgradable {
        bin,
        first,
        dir: _dir,
    } = Upgradable::start(listen, backend.addr(), |b| {
        b.env("NOTIFY_SOCKET", &notify_path)
    })
    .await?;
    let admin = first.admin_addr();
    let cookies = cookies_at(admin).await?;
    let args = cmdline(first.pid())?;
    let load = Load::start(listen, 20);
    let mut pid = first.pid();
    let mut guards = Vec::new();
    let mut messages = String::new();
    for i in 0..3 {
        // A connection carried by the old instance keeps working while it drains.
        let mut carried = TcpClient::connect(listen).await?;
        carried.round_trip(b"before").await?;
        let size = install_binary(&bin, &format!("\nupgrade {i}\n"))?;
        let next = upgrade(pid, admin).await?;
        guards.push(PidGuard(next));
        carried.round_trip(b"while draining").await?;
        drop(carried);
        if i == 0 {
            let status = first.wait_exit(UPGRADE_DEADLINE).await?;
            ensure!(status.success(), "first instance exited with {status}");
        } else {
            wait_gone(pid).await?;
        }
        let exe = std::fs::read_link(format!("/proc/{next}/exe"))?;
        ensure!(
            exe == bin,
            "successor runs {} rather than {}",
            exe.display(),
            bin.display()
        );
        let ran = std::fs::metadata(format!("/proc/{next}/exe"))?.len();
        ensure!(
            ran == size,
            "successor runs a file of {ran} bytes, the replaced one has {size}"
        );
        ensure!(
            cmdline(next)? == args,
            "successor started with other arguments"
        );
        ensure!(
            cookies_at(admin).await? == cookies,
            "listener identity changed"
        );
        let mut buf = [0u8; 256];
        while let Ok(n) = notify.recv(&mut buf) {
            messages.push_str(&String::from_utf8_lossy(&buf[..n]));
            messages.push('\n');
        }
        ensure!(
            messages.contains(&format!("MAINPID={next}")),
            "systemd was not told the new main pid {next}: {messages:?}"
        );
        pid = next;
    }
    ensure!(messages.contains("READY=1"), "no READY=1: {messages:?}");
    let report = load.stop().await;
    ensure!(report.ok > 0, "no request completed");
    if !report.failures.is_empty() {
        bail!("{}; first: {:?}", report.summary(), &report.failures[..1]);
    }
    drop(guards);
    Ok(())
}

/// Established connections move to the successor: with a drain timeout longer than the test's
/// deadline, an old instance that kept any connection would still be running; every stream
/// (some of them bulk, so bytes are in flight in the copy when it pauses) keeps its byte
/// sequence intact and none is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upgrade_hands_over_established_connections() -> Result<()> {
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(120))
    })
    .await?;
    let admin = up.first.admin_addr();
    let load = Load::start(listen, 10);
    let streams = Streams::start(listen, 24, Duration::from_millis(10), |i| {
        if i % 4 == 0 {
            8192
        } else {
            1
        }
    })
    .await?;
    let mut pid = up.first.pid();
    let mut guards = Vec::new();
    for _ in 0..3 {
        let words = streams.words();
        let next = upgrade(pid, admin).await?;
        guards.push(PidGuard(next));
        wait_gone(pid)
            .await
            .context("old instance kept connections")?;
        ensure!(
            streams.failed() == 0,
            "a stream failed: {}",
            streams.first_failures(5)
        );
        eventually(UPGRADE_DEADLINE, || async {
            ensure!(streams.words() > words + 10_000, "streams stalled");
            Ok(())
        })
        .await?;
        pid = next;
    }
    let report = streams.stop().await;
    let load = load.stop().await;
    let log = up.first.stderr();
    println!("{}; churn: {}", report.summary(), load.summary());
    for line in log
        .lines()
        .filter(|l| l.contains("connections handed over"))
    {
        println!("{line}");
    }
    ensure!(report.failures.is_empty(), "{:?}", report.failures);
    ensure!(load.failures.is_empty(), "{}", load.summary());
    ensure!(
        log.matches("established connections handed over").count() == 3,
        "every upgrade hands connections over"
    );
    drop(guards);
    Ok(())
}

/// The pod's readiness probe never fails during an in-place upgrade, and `/status` on the
/// admin address names the new pid only once the upgrade is done. The admin socket is shared
/// by the two processes; `/readyz` is polled on it (a new connection each time, as the exec
/// probe does) from the SIGUSR2 until the old process is gone, while the successor's health
/// checks take a while to pass (3 × 300ms) and established connections are handed over.
/// Before, the successor answered on the socket from its start: `/readyz` 503
/// (WaitingForBackend) to a good part of the polls, and its pid in `/status` while the old
/// process was still handing over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_holds_and_status_names_the_successor_only_when_done() -> Result<()> {
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let dir = TempDir::new("upgrade-readiness")?;
    std::fs::create_dir_all(dir.join("bin"))?;
    let bin = dir.join("bin").join("kube-apiserver-proxy");
    install_binary(&bin, "")?;
    let first = ProxyBuilder::new()
        .bin(&bin)
        .listen(listen)
        .backend(backend.addr())
        .health_check("tcp")
        .health_timing(Duration::from_millis(300), 3, 2)
        .drain_timeout(Duration::from_secs(60))
        .arg("--handoff-dir")
        .arg(dir.join("handoff"))
        .spawn()
        .await?;
    let admin = first.admin_addr();
    eventually(Duration::from_secs(10), || async {
        ensure!(admin_pid(admin).await?.1, "not ready");
        Ok(())
    })
    .await?;
    let streams = Streams::start(listen, 8, Duration::from_millis(10), |_| 1).await?;
    // Besides the loop below, probes that never pause: one that lands in the moment the old
    // process stops answering on the admin socket must be answered ready too.
    let probing = Arc::new(AtomicBool::new(true));
    let mut probes = Vec::new();
    for _ in 0..4 {
        let probing = probing.clone();
        probes.push(tokio::spawn(async move {
            let (mut polls, mut failed) = (0u32, Vec::new());
            while probing.load(Ordering::Relaxed) {
                polls += 1;
                match http_get(admin, "/readyz").await {
                    Ok((200, _)) => {}
                    Ok((code, body)) => failed.push(format!("{code} {}", body.trim())),
                    Err(e) => failed.push(format!("{e:#}")),
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (polls, failed)
        }));
    }
    let mut pid = first.pid();
    let mut guards = Vec::new();
    let (mut polls, mut failed) = (0u32, Vec::new());
    for round in 0..3 {
        install_binary(&bin, &format!("\nreadiness {round}\n"))?;
        kill(Pid::from_raw(pid as i32), Signal::SIGUSR2).context("kill -USR2")?;
        let started = tokio::time::Instant::now();
        let mut next = None;
        loop {
            ensure!(
                started.elapsed() < UPGRADE_DEADLINE,
                "round {round}: no successor answered in time"
            );
            polls += 1;
            match http_get(admin, "/readyz").await {
                Ok((200, _)) => {}
                Ok((code, body)) => failed.push(format!("round {round}: {code} {}", body.trim())),
                Err(e) => failed.push(format!("round {round}: {e:#}")),
            }
            if next.is_none() {
                if let Ok((now, _)) = admin_pid(admin).await {
                    if now != pid {
                        // The new pid shows only once the old process has handed over its
                        // listening sockets and connections (its log says so first).
                        let log = first.stderr();
                        let handed = log.lines().any(|l| {
                            l.contains("in-place upgrade: handed over")
                                && l.contains(&format!("successor.pid={now}"))
                        });
                        ensure!(
                            handed,
                            "round {round}: /status names {now} before pid {pid} handed over"
                        );
                        next = Some(now);
                        guards.push(PidGuard(now));
                    }
                }
            }
            if next.is_some() && !alive(pid) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        pid = next.expect("set above");
    }
    probing.store(false, Ordering::Relaxed);
    for p in probes {
        let (n, f) = p.await?;
        polls += n;
        failed.extend(f.into_iter().map(|f| format!("probe: {f}")));
    }
    let report = streams.stop().await;
    ensure!(
        failed.is_empty(),
        "/readyz failed {} of {polls} polls: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    ensure!(report.failures.is_empty(), "{:?}", report.failures);
    drop(guards);
    Ok(())
}

/// CPU time (utime + stime, in clock ticks) of each thread of `pid`, by thread name.
fn thread_cpu(pid: u32) -> Result<Vec<(String, u64)>> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let dir = task?.path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("stat")),
        ) else {
            continue; // the thread ended meanwhile
        };
        // After the command name in parentheses: state is field 3, utime 14, stime 15.
        let rest = stat.rsplit_once(')').context("stat without comm")?.1;
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let ticks = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
        out.push((comm.trim().to_owned(), ticks));
    }
    Ok(out)
}

/// With a runtime per worker thread (the default), connections taken over at an in-place
/// upgrade are carried by the worker threads, like accepted ones, not by the main thread,
/// which also runs the health checks, admin and handoff.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taken_over_connections_run_on_the_worker_threads() -> Result<()> {
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(120))
            .arg("--worker-threads")
            .arg("2")
            // Through user space: more CPU per byte to tell the threads apart by.
            .arg("--copy-mode")
            .arg("buffered")
    })
    .await?;
    let admin = up.first.admin_addr();
    // Bulk streams only (64 KiB every 10 ms each): the successor's CPU goes to carrying them.
    let streams = Streams::start(listen, 8, Duration::from_millis(10), |_| 8192).await?;
    let first = up.first.pid();
    let next = upgrade(first, admin).await?;
    let _guard = PidGuard(next);
    wait_gone(first)
        .await
        .context("old instance kept connections")?;
    ensure!(
        streams.failed() == 0,
        "a stream failed at the upgrade: {}",
        streams.first_failures(5)
    );
    // No new connection from now on: every byte the successor moves is a taken-over one's.
    let before = thread_cpu(next)?;
    let words = streams.words();
    eventually(UPGRADE_DEADLINE, || async {
        ensure!(
            streams.words() > words + 20_000_000,
            "streams moved {} words",
            streams.words() - words
        );
        Ok(())
    })
    .await?;
    let after = thread_cpu(next)?;
    let report = streams.stop().await;
    ensure!(report.failures.is_empty(), "{:?}", report.failures);
    // CPU ticks spent in the window by the threads whose name passes `on`.
    let spent = |on: fn(&str) -> bool| -> u64 {
        let sum =
            |v: &[(String, u64)]| -> u64 { v.iter().filter(|(n, _)| on(n)).map(|(_, t)| t).sum() };
        sum(&after) - sum(&before)
    };
    let (w0, w1) = (spent(|n| n == "worker-0"), spent(|n| n == "worker-1"));
    let workers = w0 + w1;
    let others = spent(|n| !n.starts_with("worker-"));
    println!("successor CPU while carrying taken-over streams: worker threads {workers} ticks ({w0} + {w1}), other threads {others} ticks");
    let log = up.first.stderr();
    ensure!(
        log.contains("established connections handed over"),
        "the upgrade handed connections over"
    );
    ensure!(
        workers > others,
        "taken-over connections are carried by the worker threads: {workers} ticks there, {others} on the others"
    );
    ensure!(
        w0 > 0 && w1 > 0,
        "taken-over connections are spread over both worker threads: {w0} and {w1} ticks"
    );
    Ok(())
}

/// Upgrades in the proof below (the count the design asks of CI); `KAP_TEST_UPGRADES`
/// overrides (a smaller count fails in CI and is reported as a shrunk proof elsewhere:
/// [`proof_count`]).
const UPGRADES: usize = 100;
const UPGRADES_ENV: &str = "KAP_TEST_UPGRADES";
/// Long-lived streams in the proof; `KAP_TEST_STREAMS` overrides (as `KAP_TEST_UPGRADES`).
const STREAMS: usize = 200;
const STREAMS_ENV: &str = "KAP_TEST_STREAMS";
/// Churn clients (a new connection per request), as in the listener handoff proof.
const CHURN_CLIENTS: usize = 100;

#[test]
fn upgrades_under_load_cut_no_stream() -> Result<()> {
    super::handoff::run_in_netns("upgrade::inner_upgrades_under_load_cut_no_stream")
}

/// The proof of the in-place upgrade, in a private network namespace with
/// `tcp_migrate_req=0`: consecutive SIGUSR2 upgrades under the churn load of the handoff proof
/// plus long-lived streams that send and check a sequence number every 10 ms (every 40th of
/// them bulk: 64 KiB per tick, so bytes are in flight when a copy pauses). No request may fail,
/// no stream be cut or see a byte lost, duplicated or reordered, and every old instance must be
/// gone long before its drain deadline (it kept no connection). The listener identity is the
/// same throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through upgrades_under_load_cut_no_stream"]
async fn inner_upgrades_under_load_cut_no_stream() -> Result<()> {
    super::handoff::inner_setup()?;
    let upgrades = proof_count(UPGRADES_ENV, UPGRADES);
    let n_streams = proof_count(STREAMS_ENV, STREAMS);
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(300))
            .args(["--max-connections", "10000"])
    })
    .await?;
    let admin = up.first.admin_addr();
    let cookies = cookies_at(admin).await?;
    let streams = Streams::start(listen, n_streams, Duration::from_millis(10), |i| {
        if i % 40 == 0 {
            8192
        } else {
            1
        }
    })
    .await?;
    let load = Load::start(listen, CHURN_CLIENTS);
    let started = std::time::Instant::now();
    let mut pid = up.first.pid();
    let mut guard = None;
    for i in 0..upgrades {
        let (ok, words) = (load.ok(), streams.words());
        let next = upgrade(pid, admin)
            .await
            .with_context(|| format!("upgrade {i}"))?;
        let previous = guard.replace(PidGuard(next));
        wait_gone(pid)
            .await
            .with_context(|| format!("upgrade {i}: the old instance kept connections"))?;
        drop(previous);
        ensure!(
            streams.failed() == 0 && load.failed() == 0,
            "upgrade {i}: {} streams cut, {} requests failed (streams: {})",
            streams.failed(),
            load.failed(),
            streams.first_failures(5)
        );
        ensure!(
            cookies_at(admin).await? == cookies,
            "listener identity changed"
        );
        eventually(UPGRADE_DEADLINE, || async {
            ensure!(
                load.ok() > ok + 100 && streams.words() > words + 10_000,
                "no progress"
            );
            Ok(())
        })
        .await?;
        pid = next;
    }
    let elapsed = started.elapsed();
    let report = streams.stop().await;
    let load = load.stop().await;
    let log = up.first.stderr();
    let (mut p99s, mut maxes, mut taken) = (Vec::new(), Vec::new(), 0u64);
    for line in log
        .lines()
        .filter(|l| l.contains("established connections handed over"))
    {
        let field = |name: &str| -> Option<f64> {
            let rest = line.split(&format!("{name}=")).nth(1)?;
            rest.split_whitespace().next()?.parse().ok()
        };
        p99s.push(field("pause_p99_ms").unwrap_or(f64::NAN));
        maxes.push(field("pause_max_ms").unwrap_or(f64::NAN));
        taken += field("taken").unwrap_or(0.0) as u64;
    }
    p99s.sort_by(f64::total_cmp);
    let worst = maxes.iter().copied().fold(0.0, f64::max);
    println!(
        "{upgrades} upgrades in {:.1}s: {}; churn ({CHURN_CLIENTS} clients): {}; {taken} connections handed over; pause per connection: median of the upgrades' p99 {:.1} ms, worst p99 {:.1} ms, max {:.1} ms",
        elapsed.as_secs_f64(),
        report.summary(),
        load.summary(),
        p99s.get(p99s.len() / 2).copied().unwrap_or(0.0),
        p99s.last().copied().unwrap_or(0.0),
        worst,
    );
    ensure!(report.failures.is_empty(), "{:?}", report.failures);
    ensure!(
        load.ok > 0 && load.failures.is_empty(),
        "{}",
        load.summary()
    );
    ensure!(report.words > 0, "no stream data checked");
    ensure!(
        p99s.len() == upgrades,
        "{} of {upgrades} upgrades logged a connection handoff",
        p99s.len()
    );
    Ok(())
}

#[test]
fn sigkill_mid_transfer_fails_only_connections_not_taken() -> Result<()> {
    super::handoff::run_in_netns(
        "upgrade::inner_sigkill_mid_transfer_fails_only_connections_not_taken",
    )
}

/// The old instance is SIGKILLed in the middle of handing its connections over: right after the
/// successor logged that it took the first batch. Connections the old instance still owned may
/// fail; none that the successor acknowledged (the client addresses it logs per batch), and no
/// connect fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through sigkill_mid_transfer_fails_only_connections_not_taken"]
async fn inner_sigkill_mid_transfer_fails_only_connections_not_taken() -> Result<()> {
    super::handoff::inner_setup()?;
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(300))
            .args(["--max-connections", "10000"])
    })
    .await?;
    let admin = up.first.admin_addr();
    const STREAMS: usize = 150;
    let streams = Streams::start(listen, STREAMS, Duration::from_millis(10), |i| {
        if i % 30 == 0 {
            8192
        } else {
            1
        }
    })
    .await?;
    let load = Load::start(listen, 50);
    let mut pid = up.first.pid();
    let mut guard = None;
    let taken_line = "took over established connections";
    // Per round: when it started, and the client addresses its successor took.
    let mut rounds: Vec<(std::time::Instant, HashSet<SocketAddr>)> = Vec::new();
    let mut failed_before = 0;
    let mut taken_total = 0;
    for round in 0..3 {
        let before = up.first.stderr().matches(taken_line).count();
        let words = streams.words();
        let started = std::time::Instant::now();
        kill(Pid::from_raw(pid as i32), Signal::SIGUSR2)?;
        // Kill as soon as the successor has taken a first batch (polled tightly: the rest of
        // the transfer takes milliseconds).
        let deadline = started + UPGRADE_DEADLINE;
        while up.first.stderr().matches(taken_line).count() == before {
            ensure!(
                std::time::Instant::now() < deadline,
                "round {round}: no connection taken by a successor"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL)?;
        wait_gone(pid).await?;
        let next = eventually(UPGRADE_DEADLINE, || async {
            let (now, ready) = admin_pid(admin).await?;
            ensure!(now != pid && ready, "admin answers for {now}");
            Ok(now)
        })
        .await?;
        guard = Some(PidGuard(next));
        // The streams left go on (each SIGKILL cuts the ones not taken yet: when the batches
        // taken before it held no stream, none is left).
        eventually(UPGRADE_DEADLINE, || async {
            let left = STREAMS - streams.failed_locals().len();
            ensure!(
                left == 0 || streams.words() > words + 1000,
                "streams stalled ({left} left)"
            );
            Ok(())
        })
        .await?;
        let taken = taken_clients(&up.first.stderr(), taken_line, before);
        let failed = streams.failed_locals();
        for local in &failed[failed_before..] {
            ensure!(
                !taken.contains(local),
                "round {round}: stream {local} failed although the successor had taken it"
            );
        }
        println!(
            "round {round}: successor took {} connections; {} streams cut with the old instance",
            taken.len(),
            failed.len() - failed_before
        );
        failed_before = failed.len();
        taken_total += taken.len();
        rounds.push((started, taken));
        pid = next;
    }
    let report = streams.stop().await;
    let load = load.stop().await;
    drop(guard.take());
    println!(
        "3 SIGKILLs mid-transfer: {taken_total} connections taken by successors; streams: {}; churn: {}",
        report.summary(),
        load.summary()
    );
    for f in &load.failures {
        let local = f.local.with_context(|| format!("connect failed: {f:?}"))?;
        let round = rounds.iter().rev().find(|(t, _)| *t <= f.started);
        ensure!(
            !round.is_some_and(|(_, taken)| taken.contains(&local)),
            "request {local} failed although the successor had taken it"
        );
    }
    Ok(())
}

/// The client addresses successors logged as taken, in the log lines after the first `skip`.
fn taken_clients(log: &str, line: &str, skip: usize) -> HashSet<SocketAddr> {
    log.lines()
        .filter(|l| l.contains(line))
        .skip(skip)
        .filter_map(|l| l.split("clients=").nth(1))
        .flat_map(|c| {
            c.split_whitespace()
                .next()
                .unwrap_or("")
                .trim_matches('"')
                .split(',')
                .filter_map(|a| a.parse().ok())
                .collect::<Vec<SocketAddr>>()
        })
        .collect()
}

#[test]
fn wildcard_listener_hands_over_connections() -> Result<()> {
    super::handoff::run_in_netns("upgrade::inner_wildcard_listener_hands_over_connections")
}

/// With `--listen 0.0.0.0:PORT` (in the private namespace: nothing is exposed) a client
/// socket's own address is a concrete one; the successor still recognises it as on its
/// listener and takes the connections: the old instance is gone long before its drain deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a network namespace through wildcard_listener_hands_over_connections"]
async fn inner_wildcard_listener_hands_over_connections() -> Result<()> {
    super::handoff::inner_setup()?;
    let backend = FakeApiserver::tcp_echo().start().await?;
    let port = free_random_loopback_addr()?.port();
    let listen = SocketAddr::from(([0, 0, 0, 0], port));
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(120))
    })
    .await?;
    let streams = Streams::start(
        SocketAddr::from(([127, 0, 0, 1], port)),
        10,
        Duration::from_millis(10),
        |_| 1,
    )
    .await?;
    let next = upgrade(up.first.pid(), up.first.admin_addr()).await?;
    let _guard = PidGuard(next);
    up.first
        .wait_exit(UPGRADE_DEADLINE)
        .await
        .context("old instance kept connections")?;
    let report = streams.stop().await;
    ensure!(report.failures.is_empty(), "{:?}", report.failures);
    Ok(())
}

/// How many connections one in-place upgrade logged as carried (`carried=N` of its
/// `established connections handed over` line), in the order they happened.
fn carried_counts(stderr: &str) -> Vec<usize> {
    stderr
        .lines()
        .filter(|l| l.contains("in-place upgrade: established connections handed over"))
        .filter_map(|l| {
            l.split("carried=")
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Version skew with the previous release, really built: a pinned commit of this repository
/// (`tests/previous-release`, cached under `target/previous/`), both directions, both ways of
/// handing over, each under 20 long-lived streams (4 of them bulk, so bytes are in flight)
/// and a churn of short connections:
///
/// - in place (SIGUSR2, `systemctl reload`): this build → the previous release (a rollback)
///   → this build again. Each predecessor has a 120 s drain timeout and must be gone within
///   30 s, so each carried every established connection to its successor; the streams live
///   through both upgrades with their byte sequences intact;
/// - side by side (as pods roll): the previous release hands its listening sockets to this
///   build at SIGTERM, and this build to the previous release.
///
/// No stream is cut, no request fails. Skipped, loudly, only where the clone has no history to
/// build the release from (a shallow clone); in CI that fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn previous_release_hands_over_both_ways() -> Result<()> {
    const TEST: &str = "upgrade::previous_release_hands_over_both_ways";
    let Some(previous) = previous_release_bin()? else {
        return skip(
            TEST,
            "the previous release's commit is not in this clone (tests/previous-release exit 2)",
        );
    };
    let previous_bytes = std::fs::read(&previous)?;
    let backend = FakeApiserver::tcp_echo().start().await?;

    // In place: this build → the previous release → this build.
    let listen = free_random_loopback_addr()?;
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(120))
    })
    .await?;
    let admin = up.first.admin_addr();
    let streams = Streams::start(listen, 20, Duration::from_millis(10), |i| {
        if i % 5 == 0 {
            8192
        } else {
            1
        }
    })
    .await?;
    let load = Load::start(listen, 10);
    install_bytes(&up.bin, &previous_bytes)?;
    let older = upgrade(up.first.pid(), admin).await?;
    let _older = PidGuard(older);
    let status = up
        .first
        .wait_exit(UPGRADE_DEADLINE)
        .await
        .context("this build kept connections after its upgrade to the previous release")?;
    ensure!(status.success(), "{status}");
    ensure!(
        std::fs::metadata(format!("/proc/{older}/exe"))?.len() == previous_bytes.len() as u64,
        "the successor does not run the previous release"
    );
    let words = streams.words();
    eventually(UPGRADE_DEADLINE, || async {
        ensure!(streams.words() > words + 10_000, "streams stalled");
        Ok(())
    })
    .await?;
    install_binary(&up.bin, "\nthis build again\n")?;
    let newer = upgrade(older, admin).await?;
    let _newer = PidGuard(newer);
    wait_gone(older)
        .await
        .context("the previous release kept connections after its upgrade to this build")?;
    let words = streams.words();
    eventually(UPGRADE_DEADLINE, || async {
        ensure!(streams.words() > words + 10_000, "streams stalled");
        Ok(())
    })
    .await?;
    let report = streams.stop().await;
    let churn = load.stop().await;
    // Both instances' logs: successors write to the stderr they inherited.
    let carried = carried_counts(&up.first.stderr());
    println!(
        "in place, this build → previous release → this build: carried {carried:?}; \
         streams {}; churn {}",
        report.summary(),
        churn.summary()
    );
    ensure!(
        carried.len() == 2 && carried.iter().all(|&n| n >= 20),
        "each upgrade must carry the 20 streams: {carried:?}"
    );
    ensure!(report.failures.is_empty(), "{:?}", report.failures);
    ensure!(
        churn.failures.is_empty() && churn.ok > 0,
        "{}",
        churn.summary()
    );

    // Side by side, as pods roll: the previous release → this build → the previous release,
    // each at SIGTERM.
    let listen = free_random_loopback_addr()?;
    let dir = TempDir::new("skew")?;
    let start = |bin: Option<&Path>| {
        let mut b = ProxyBuilder::tcp(listen, backend.addr())
            .drain_timeout(Duration::from_secs(10))
            .arg("--handoff-dir")
            .arg(dir.join("handoff"));
        if let Some(bin) = bin {
            b = b.bin(bin);
        }
        b
    };
    let mut old = start(Some(&previous)).spawn().await?;
    old.wait_state("Serving").await?;
    let load = Load::start(listen, 10);
    for (to, name) in [
        (None, "this build"),
        (Some(previous.as_path()), "the previous release"),
    ] {
        let new = start(to).spawn().await?;
        new.wait_state("Serving").await?;
        eventually(UPGRADE_DEADLINE, || async {
            let (code, _) = new.admin_get("/readyz").await?;
            ensure!(code == 200, "/readyz {code}");
            Ok(())
        })
        .await?;
        old.sigterm()?;
        let status = old.wait_exit(UPGRADE_DEADLINE).await?;
        ensure!(status.success(), "{status}");
        ensure!(
            old.stderr().contains("listening sockets adopted by peer"),
            "no handover to {name}"
        );
        TcpClient::connect(listen)
            .await?
            .round_trip(b"after")
            .await?;
        old = new;
    }
    let churn = load.stop().await;
    println!(
        "side by side, previous release → this build → previous release at SIGTERM: churn {}",
        churn.summary()
    );
    ensure!(
        churn.failures.is_empty() && churn.ok > 0,
        "{}",
        churn.summary()
    );
    Ok(())
}

/// A successor that cannot start (here: a replaced "binary" that rejects its input) leaves the
/// old instance serving, with its listeners and admin endpoint; a later good binary upgrades.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_successor_leaves_the_old_instance_serving() -> Result<()> {
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(10))
    })
    .await?;
    let admin = up.first.admin_addr();
    let load = Load::start(listen, 10);
    install_bytes(&up.bin, b"#!/bin/sh\necho 'error: bad input' >&2\nexit 2\n")?;
    kill(Pid::from_raw(up.first.pid() as i32), Signal::SIGUSR2)?;
    up.first.wait_stderr("in-place upgrade failed").await?;
    up.first.ensure_running()?;
    ensure!(
        admin_pid(admin).await? == (up.first.pid(), true),
        "old instance not serving"
    );
    TcpClient::connect(listen)
        .await?
        .round_trip(b"still here")
        .await?;
    install_binary(&up.bin, "\ngood\n")?;
    let next = upgrade(up.first.pid(), admin).await?;
    let _guard = PidGuard(next);
    up.first.wait_exit(UPGRADE_DEADLINE).await?;
    let report = load.stop().await;
    ensure!(
        report.failures.is_empty() && report.ok > 0,
        "{}",
        report.summary()
    );
    Ok(())
}

/// Without `--handoff-dir` there is no way to hand over: SIGUSR2 is refused with a log line
/// and the instance goes on serving (the default action of SIGUSR2 would have killed it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigusr2_without_handoff_dir_keeps_serving() -> Result<()> {
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = free_random_loopback_addr()?;
    let proxy = ProxyBuilder::tcp(listen, backend.addr()).spawn().await?;
    proxy.wait_state("Serving").await?;
    proxy.signal(Signal::SIGUSR2)?;
    proxy
        .wait_stderr("in-place upgrade needs --handoff-dir")
        .await?;
    proxy.ensure_running()?;
    TcpClient::connect(listen).await?.round_trip(b"x").await?;
    Ok(())
}

/// The systemd unit reloads in place: `systemctl reload` sends SIGUSR2 to the main process,
/// and systemd follows the main pid to the successor.
#[test]
fn systemd_unit_reloads_in_place() -> Result<()> {
    let unit = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../manifests/systemd/kube-apiserver-proxy.service"),
    )?;
    for line in [
        "Type=notify",
        "NotifyAccess=all",
        "ExecReload=/bin/kill -USR2 $MAINPID",
    ] {
        ensure!(
            unit.lines().any(|l| l.trim() == line),
            "unit lacks {line:?}"
        );
    }
    Ok(())
}

/// Every unit's `Documentation=` names a document the install steps put on the node (and that
/// exists in `docs/`), not a web address that may not exist.
#[test]
fn systemd_units_document_what_they_install() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let main =
        std::fs::read_to_string(root.join("manifests/systemd/kube-apiserver-proxy.service"))?;
    let installs_docs = main.lines().any(|l| {
        l.contains("install")
            && l.contains("/usr/share/doc/kube-apiserver-proxy")
            && l.contains("docs/*.md")
    });
    ensure!(installs_docs, "the install steps do not install docs/*.md");
    for unit in [
        "kube-apiserver-proxy.service",
        "kube-apiserver-proxy@.service",
    ] {
        let text = std::fs::read_to_string(root.join("manifests/systemd").join(unit))?;
        let docs: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("Documentation="))
            .flat_map(str::split_whitespace)
            .collect();
        ensure!(!docs.is_empty(), "{unit}: no Documentation=");
        for url in docs {
            let name = url
                .strip_prefix("file:///usr/share/doc/kube-apiserver-proxy/")
                .with_context(|| format!("{unit}: Documentation={url} is not an installed file"))?;
            ensure!(
                root.join("docs").join(name).is_file(),
                "{unit}: Documentation={url}: no docs/{name}"
            );
        }
    }
    Ok(())
}
