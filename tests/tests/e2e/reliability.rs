//! Reliability: descriptor exhaustion, silent and non-reading clients, backend faults, hostile
//! input on every socket the proxy serves, and leaks (descriptors and tasks counted before and
//! after; descriptors and RSS of a process that lives through many peers and in-place
//! upgrades).

use std::io::Write as _;
use std::net::SocketAddr;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::handoff::listener_cookies;
use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::TcpClient;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::proxy::{require_metric, Proxy, ProxyBuilder};
use kube_apiserver_proxy_tests::util::{eventually, random_loopback_ip, TempDir};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::{echo_backend, echo_proxy, echo_proxy_with, listen_addr, serving, tcp_proxy, DEADLINE};

/// Resident memory of a process, in bytes.
fn rss(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .context("no VmRSS")?
        .trim()
        .trim_end_matches(" kB")
        .trim()
        .parse()?;
    Ok(kib * 1024)
}

/// CPU time (user + system) of a process.
fn cpu(pid: u32) -> Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    let after_comm = &stat[stat.rfind(')').context("stat")? + 2..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>()? + fields[12].parse::<u64>()?;
    Ok(Duration::from_millis(ticks * 10))
}

/// Open descriptors (less those of idle pooled splice pipes, a bounded cache) and alive tasks,
/// as the proxy reports them.
async fn resources(proxy: &Proxy) -> Result<(f64, f64)> {
    let metrics = proxy.metrics().await?;
    let read = |name| require_metric(&metrics, name, &[]);
    Ok((
        read("open_fds")? - 2.0 * read("splice_pipes_pooled")?,
        read("runtime_alive_tasks")?,
    ))
}

/// Waits until descriptors and tasks are back to `baseline` or below (no leak; the baseline
/// may include a transient admin connection).
async fn back_to(proxy: &Proxy, baseline: (f64, f64)) -> Result<()> {
    eventually(DEADLINE, || async {
        let now = resources(proxy).await?;
        ensure!(
            now.0 <= baseline.0 && now.1 <= baseline.1,
            "open_fds/tasks {now:?}, baseline {baseline:?}"
        );
        Ok(())
    })
    .await
}

async fn round_trip(listen: SocketAddr) -> Result<()> {
    let mut c = TcpClient::connect(listen).await?;
    c.round_trip(b"ping").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_exhaustion_backs_off_and_recovers() -> Result<()> {
    let (backend, listen, proxy) = echo_proxy_with(|b| b.nofile_limit(48)).await?;
    round_trip(listen).await?;
    // Far more clients than descriptors: accept() fails with EMFILE while they stay.
    let mut flood = Vec::new();
    for _ in 0..150 {
        flood.push(TcpStream::connect(listen).await?);
    }
    let cpu_before = cpu(proxy.pid())?;
    let wall = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await; // let time pass under exhaustion
    let used = cpu(proxy.pid())? - cpu_before;
    ensure!(
        used < wall.elapsed() / 4,
        "proxy used {used:?} CPU in {:?} while out of descriptors (spinning?)",
        wall.elapsed()
    );
    drop(flood);
    eventually(DEADLINE, || async { round_trip(listen).await }).await?;
    let rejected = proxy
        .metric_or_zero("connections_failed_total", &[("reason", "accept_error")])
        .await?;
    ensure!(rejected > 0.0, "accept errors not counted");
    let logged = proxy.stderr().matches("accept failed").count();
    ensure!(
        logged <= 3,
        "accept failure logged {logged} times in ~2s (rate limit broken)"
    );
    // The backend was never blamed for our own shortage.
    let entry = proxy.backend_status(backend.addr()).await?;
    ensure!(
        entry["health"] == "up",
        "backend {entry} after descriptor exhaustion"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_clients_do_not_stop_others_and_cost_little() -> Result<()> {
    const SILENT: usize = 1000;
    let (_backend, listen, proxy) = echo_proxy().await?;
    round_trip(listen).await?;
    let rss_before = rss(proxy.pid())?;
    let mut silent = Vec::with_capacity(SILENT);
    for _ in 0..SILENT {
        silent.push(TcpStream::connect(listen).await?);
    }
    eventually(DEADLINE, || async {
        let active = proxy.metric_or_zero("connections_active", &[]).await?;
        ensure!(active >= SILENT as f64, "{active} connections active");
        Ok(())
    })
    .await?;
    let started = Instant::now();
    round_trip(listen).await?;
    ensure!(
        started.elapsed() < Duration::from_secs(2),
        "a client waited {:?} behind silent ones",
        started.elapsed()
    );
    let per_connection = rss(proxy.pid())?.saturating_sub(rss_before) / SILENT as u64;
    println!("RSS per silent proxied connection: {per_connection} bytes");
    ensure!(
        per_connection < 16 * 1024,
        "{per_connection} bytes per silent connection"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_are_bounded() -> Result<()> {
    const CLIENTS: usize = 20;
    const SEND: usize = 64 << 20;
    let (_backend, listen, proxy) = echo_proxy().await?;
    let rss_before = rss(proxy.pid())?;
    let mut writers = Vec::new();
    for _ in 0..CLIENTS {
        let mut stream = TcpStream::connect(listen).await?;
        writers.push(tokio::spawn(async move {
            // Never reads: the echo fills every buffer on the way back, then ours stall.
            let chunk = vec![b'x'; 64 * 1024];
            let mut sent = 0;
            while sent < SEND {
                if stream.write_all(&chunk).await.is_err() {
                    break;
                }
                sent += chunk.len();
            }
            stream
        }));
    }
    // Wait until the flow has stopped: no more bytes move between two looks 200 ms apart.
    let mut last = -1.0;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = proxy
            .metric_or_zero("bytes_total", &[("direction", "client_to_backend")])
            .await?;
        if now > 0.0 && now == last {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "bytes still moving after 20s ({now})"
        );
        last = now;
        tokio::time::sleep(Duration::from_millis(200)).await; // sampling interval
    }
    let moved = last;
    ensure!(
        moved < (CLIENTS * SEND) as f64,
        "everything moved: nothing stalled"
    );
    let growth = rss(proxy.pid())?.saturating_sub(rss_before);
    println!("RSS growth with {CLIENTS} stalled clients: {growth} bytes ({moved} bytes moved)");
    ensure!(
        growth < (CLIENTS as u64) * 256 * 1024,
        "RSS grew by {growth} bytes for {CLIENTS} stalled connections (unbounded buffering?)"
    );
    round_trip(listen).await?;
    for w in writers {
        w.abort();
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_that_accepts_but_never_answers_is_marked_down() -> Result<()> {
    let pki = Pki::new()?;
    // A listener nobody accepts on: TCP connects succeed (the kernel queues them), TLS never does.
    let blackhole = std::net::TcpListener::bind((random_loopback_ip()?, 0))?;
    let good = FakeApiserver::https(&pki)
        .random_loopback()?
        .start()
        .await?;
    let listen = listen_addr()?;
    let proxy = serving(
        ProxyBuilder::new()
            .listen(listen)
            .backend(blackhole.local_addr()?)
            .backend(good.addr())
            .health_check("https")
            .ca_file(&pki.ca_file())
            .args(["--health-interval", "100ms", "--health-timeout", "200ms"])
            .args(["--health-rise", "1", "--health-fall", "2"]),
    )
    .await?;
    eventually(DEADLINE, || async {
        let failed = proxy
            .metric_or_zero(
                "health_checks_total",
                &[
                    ("backend", &blackhole.local_addr()?.to_string()),
                    ("result", "failed"),
                ],
            )
            .await?;
        ensure!(failed >= 2.0, "{failed} failed checks of the black hole");
        Ok(())
    })
    .await?;
    let entry = proxy.backend_status(blackhole.local_addr()?).await?;
    ensure!(
        entry["healthy"] == false,
        "black hole counted healthy: {entry}"
    );
    let client = crate::https_client(&pki)?;
    for _ in 0..10 {
        let (code, _) = client.get(listen, "/version").await?;
        ensure!(code == 200, "/version {code}");
    }
    ensure!(
        good.requests("/version") == 10,
        "not every request reached the good backend"
    );
    Ok(())
}

/// A backend that reads a little, then resets the connection.
async fn resetting_backend() -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind((random_loopback_ip()?, 0)).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4];
                if stream.read_exact(&mut buf).await.is_ok() {
                    // Linger zero: close sends RST.
                    let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
                }
                drop(stream);
            });
        }
    });
    Ok(addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_reset_mid_stream_closes_the_client_and_leaks_nothing() -> Result<()> {
    let backend = resetting_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(ProxyBuilder::tcp(listen, backend)).await?;
    let baseline = resources(&proxy).await?;
    for _ in 0..20 {
        let mut c = TcpStream::connect(listen).await?;
        c.write_all(b"abcdefgh").await?;
        let mut buf = Vec::new();
        let read = tokio::time::timeout(DEADLINE, c.read_to_end(&mut buf)).await;
        ensure!(read.is_ok(), "client not closed after the backend reset");
    }
    back_to(&proxy, baseline).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vanished_backend_leaks_nothing() -> Result<()> {
    let (backend, listen, proxy) = echo_proxy().await?;
    let baseline = resources(&proxy).await?;
    let mut clients = Vec::new();
    for _ in 0..20 {
        let mut c = TcpClient::connect(listen).await?;
        c.round_trip(b"hello").await?;
        clients.push(c);
    }
    backend.vanish().await;
    for c in &mut clients {
        c.wait_closed(DEADLINE).await?;
    }
    drop(clients);
    back_to(&proxy, baseline).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_to_accept_backend_is_skipped_after_connect_timeout() -> Result<()> {
    // Healthy at first (long interval keeps it so), then its backlog fills: SYNs are dropped.
    let slow = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    slow.bind(&SocketAddr::new(random_loopback_ip()?, 0).into())?;
    slow.listen(0)?;
    let slow_addr = slow.local_addr()?.as_socket().context("ip")?;
    let good = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(
        ProxyBuilder::new()
            .listen(listen)
            .backend(slow_addr)
            .backend(good.addr())
            .health_check("tcp")
            .args([
                "--health-interval",
                "1m",
                "--health-rise",
                "1",
                "--connect-timeout",
                "300ms",
            ]),
    )
    .await?;
    proxy.wait_backend_health(slow_addr, "up").await?;
    proxy.wait_backend_health(good.addr(), "up").await?;
    // Fill the backlog (never accepted).
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) =
            tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(slow_addr)).await
        {
            fillers.push(s);
        }
    }
    for _ in 0..3 {
        round_trip(listen).await?;
    }
    let skipped = proxy
        .metric_or_zero(
            "backend_connect_failures_total",
            &[("backend", &slow_addr.to_string())],
        )
        .await?;
    ensure!(skipped >= 1.0, "slow backend never tried and skipped");
    ensure!(
        good.active_sessions() > 0 || good.accepted() > 0,
        "good backend got nothing"
    );
    Ok(())
}

/// Connects to the proxy's handoff socket.
fn handoff_socket(dir: &std::path::Path) -> Result<std::path::PathBuf> {
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "sock"))
        .context("no handoff socket")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_the_handoff_socket_is_rejected_and_counted() -> Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let dir = TempDir::new("hostile-handoff")?;
    let handoff = dir.join("handoff");
    let proxy = serving(
        tcp_proxy(listen, &[&backend])
            .fast_health()
            .arg("--handoff-dir")
            .arg(&handoff),
    )
    .await?;
    let before = proxy.status().await?["listeners"].clone();
    let socket = handoff_socket(&handoff)?;
    let frame = |payload: &[u8]| {
        let mut f = b"KAPH\x02\x00".to_vec();
        f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        f.extend_from_slice(payload);
        f
    };
    let mut big = b"KAPH\x02\x00".to_vec();
    big.extend_from_slice(&u32::MAX.to_be_bytes());
    let cases: Vec<Vec<u8>> = vec![
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        (0..4096).map(|i| (i * 7 % 251) as u8).collect(),
        big,
        frame(b"{not json"),
        frame(br#"{"type":"ack","cookies":[]}"#),
        b"KAPH\x02\x00\x00\x00\x01".to_vec(), // truncated: peer closes mid-message
    ];
    for case in &cases {
        let mut s = UnixStream::connect(&socket)?;
        let _ = s.write_all(case);
        drop(s);
    }
    // An adopt carrying a descriptor that is not a listening socket (a pipe).
    let (pipe_r, _pipe_w) = nix::unistd::pipe()?;
    let s = UnixStream::connect(&socket)?;
    let adopt = frame(format!(r#"{{"type":"adopt","addrs":["{listen}"]}}"#).as_bytes());
    let fds = [pipe_r.as_raw_fd()];
    sendmsg::<()>(
        s.as_raw_fd(),
        &[std::io::IoSlice::new(&adopt)],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )?;
    s.set_read_timeout(Some(DEADLINE))?;
    let mut answer = Vec::new();
    let _ = std::io::Read::read_to_end(&mut &s, &mut answer);
    let answer = String::from_utf8_lossy(&answer).into_owned();
    ensure!(
        answer.contains(r#""cookies":[]"#),
        "a pipe was adopted: {answer}"
    );
    eventually(DEADLINE, || async {
        let rejected = proxy
            .metric_or_zero("handoff_messages_rejected_total", &[])
            .await?;
        ensure!(
            rejected >= cases.len() as f64,
            "{rejected} rejected of {} bad messages",
            cases.len() + 1
        );
        Ok(())
    })
    .await?;
    ensure!(
        proxy.status().await?["listeners"] == before,
        "listeners changed"
    );
    round_trip(listen).await?;
    let (code, _) = proxy.admin_get("/readyz").await?;
    ensure!(code == 200, "/readyz {code} after hostile handoff input");
    Ok(())
}

/// File-system work never runs on the runtime's workers: with one worker thread and an own
/// backend "file" whose read never returns (a FIFO nobody writes: a stand-in for a hung mount
/// or an fsync stuck behind etcd's disk), health checks, forwarding and `/metrics` go on, a
/// `--backend-dir` FIFO entry is ignored, and SIGTERM still ends the process.
#[tokio::test]
async fn a_stuck_file_read_does_not_stall_the_runtime() -> Result<()> {
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let dir = TempDir::new("stuck-read")?;
    let fifo = dir.join("own-backend");
    let backend_dir = dir.join("backends");
    std::fs::create_dir(&backend_dir)?;
    std::fs::set_permissions(&backend_dir, std::fs::Permissions::from_mode(0o700))?;
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600))?;
    nix::unistd::mkfifo(
        &backend_dir.join("1-00000000.backend"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )?;
    let proxy = serving(
        tcp_proxy(listen, &[&backend])
            .fast_health()
            .args(["--worker-threads", "1"])
            .arg("--own-backend-file")
            .arg(&fifo)
            .arg("--backend-dir")
            .arg(&backend_dir),
    )
    .await?;
    round_trip(listen).await?;
    let metrics = proxy.metrics().await?;
    ensure!(metrics.contains("open_fds"), "no /metrics");
    proxy.sigterm()?;
    let status = proxy.wait_exit(DEADLINE).await?;
    ensure!(status.success(), "exit {status}");
    Ok(())
}

/// The soft descriptor limit (often 1024 in a pod) is raised to the hard limit at start.
#[tokio::test]
async fn the_soft_descriptor_limit_is_raised_to_the_hard_limit() -> Result<()> {
    let (_backend, _listen, proxy) = echo_proxy_with(|b| {
        b.args(["--max-connections", "100"])
            .nofile_soft_hard(64, 4096)
    })
    .await?;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", proxy.pid()))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .context("no open files limit")?;
    let fields: Vec<&str> = line.split_whitespace().collect();
    ensure!(
        fields[3] == "4096" && fields[4] == "4096",
        "limit not raised: {line}"
    );
    // The line saying the limit was raised comes where the warning would have.
    proxy
        .wait_stderr("RLIMIT_NOFILE raised to the hard limit")
        .await?;
    ensure!(
        !proxy
            .stderr()
            .contains("below what --max-connections needs"),
        "warned although the limit suffices"
    );
    Ok(())
}

/// A hard limit below what `--max-connections` needs is said at start, naming the flag.
#[tokio::test]
async fn a_descriptor_limit_too_low_for_max_connections_is_warned_about() -> Result<()> {
    let (_backend, _listen, proxy) = echo_proxy_with(|b| {
        b.args(["--max-connections", "10000"])
            .nofile_soft_hard(512, 1024)
    })
    .await?;
    proxy
        .wait_stderr("RLIMIT_NOFILE is below what --max-connections needs")
        .await?;
    Ok(())
}

/// A peer shuts the shared listening socket down (which every holder then sees as "not
/// listening": `accept()` fails with EINVAL, at once and forever). The proxy must drop that
/// socket from its set and say so, not retry it in a loop at full speed; and as the address
/// has no socket left, bind a fresh one so it serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_that_can_no_longer_accept_is_dropped_and_reported() -> Result<()> {
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let dir = TempDir::new("shutdown-listener")?;
    let handoff = dir.join("handoff");
    // One worker thread: one socket for the address, whose loss leaves it dark.
    let proxy = serving(
        tcp_proxy(listen, &[&backend])
            .fast_health()
            .args(["--worker-threads", "1"])
            .arg("--handoff-dir")
            .arg(&handoff),
    )
    .await?;
    let listeners = proxy.status().await?["listeners"].clone();
    ensure!(
        listeners.as_array().is_some_and(|l| l.len() == 1),
        "expected one listener: {listeners}"
    );
    let fds =
        kube_apiserver_proxy_tests::sockets::share_request(&handoff_socket(&handoff)?, listen)?;
    socket2::SockRef::from(&fds[0]).shutdown(std::net::Shutdown::Both)?;
    let old_cookie = listeners[0]["cookie"].clone();
    eventually(DEADLINE, || async {
        let status = proxy.status().await?;
        let now = status["listeners"].as_array().context("listeners")?;
        ensure!(
            now.len() == 1 && now[0]["cookie"] != old_cookie && now[0]["origin"] == "rebound",
            "not replaced: {}",
            status["listeners"]
        );
        Ok(())
    })
    .await?;
    round_trip(listen).await?;
    proxy
        .wait_stderr("listening socket can no longer accept: dropped")
        .await?;
    let dropped = proxy
        .metric_or_zero("listening_sockets_dropped_total", &[])
        .await?;
    ensure!(
        dropped == 1.0,
        "listening_sockets_dropped_total = {dropped}"
    );
    let errors = proxy
        .metric_or_zero("connections_failed_total", &[("reason", "accept_error")])
        .await?;
    ensure!(
        errors <= 1.0,
        "{errors} accept errors counted for one dead socket"
    );
    let (code, _) = proxy.admin_get("/healthz").await?;
    ensure!(code == 200, "/healthz {code}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_admin_requests_are_rejected_and_counted() -> Result<()> {
    let (_backend, listen, proxy) = echo_proxy().await?;
    let admin = proxy.admin_addr();
    let send = |request: Vec<u8>| async move {
        let mut s = TcpStream::connect(admin).await?;
        let _ = s.write_all(&request).await;
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(DEADLINE, s.read_to_end(&mut answer)).await;
        anyhow::Ok(String::from_utf8_lossy(&answer).into_owned())
    };
    let post = send(
        b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            .to_vec(),
    )
    .await?;
    ensure!(post.starts_with("HTTP/1.1 405"), "POST answered {post:?}");
    let delete =
        send(b"DELETE /status HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec()).await?;
    ensure!(
        delete.starts_with("HTTP/1.1 405"),
        "DELETE answered {delete:?}"
    );
    let mut huge = b"GET /status HTTP/1.1\r\nHost: x\r\nX-Big: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 1 << 20));
    huge.extend_from_slice(b"\r\n\r\n");
    let big = send(huge).await?;
    ensure!(
        !big.starts_with("HTTP/1.1 200"),
        "a 1 MiB header was served: {}",
        &big[..big.len().min(80)]
    );
    let garbage = send((0..2048).map(|i| (i * 13 % 256) as u8).collect()).await?;
    ensure!(!garbage.starts_with("HTTP/1.1 200"), "garbage served");
    let rejected = proxy
        .metric_or_zero("admin_requests_rejected_total", &[])
        .await?;
    ensure!(rejected >= 2.0, "admin_requests_rejected_total {rejected}");
    round_trip(listen).await?;
    let (code, _) = proxy.admin_get("/healthz").await?;
    ensure!(code == 200, "/healthz {code}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tls_on_health_checks_fails_the_check_only() -> Result<()> {
    // A backend that answers a TLS ClientHello with an echo of it: not TLS.
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = ProxyBuilder::new()
        .listen(listen)
        .backend(backend.addr())
        .health_check("https")
        .arg("--health-insecure-skip-verify")
        .fast_health()
        .spawn()
        .await?;
    eventually(DEADLINE, || async {
        let failed = proxy
            .metric_or_zero("health_checks_total", &[("result", "failed")])
            .await?;
        ensure!(failed >= 3.0, "{failed} failed checks");
        Ok(())
    })
    .await?;
    ensure!(
        proxy.state().await? == "WaitingForBackend",
        "a non-TLS backend passed an https check"
    );
    let (code, _) = proxy.admin_get("/healthz").await?;
    ensure!(code == 200, "/healthz {code}");
    Ok(())
}

/// A backend outage under many clients counts every failure but logs at most one line a
/// second per kind (no log flood).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_storm_logs_are_rate_limited() -> Result<()> {
    const CLIENTS: usize = 200;
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    // Long interval: the backend stays "up" after it vanishes, so every client tries it.
    // Each client is held for --connect-timeout while the backend is retried: keep it short
    // and the clients concurrent.
    let proxy = serving(tcp_proxy(listen, &[&backend]).args([
        "--health-interval",
        "1m",
        "--health-rise",
        "1",
        "--connect-timeout",
        "300ms",
    ]))
    .await?;
    backend.vanish().await;
    let started = Instant::now();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..CLIENTS {
        clients.spawn(async move {
            let mut c = TcpStream::connect(listen).await?;
            let mut buf = Vec::new();
            let _ = tokio::time::timeout(DEADLINE, c.read_to_end(&mut buf)).await;
            anyhow::Ok(())
        });
    }
    while let Some(done) = clients.join_next().await {
        done??;
    }
    let failed = proxy
        .metric_or_zero("connections_failed_total", &[("reason", "no_backend")])
        .await?;
    ensure!(
        failed >= CLIENTS as f64,
        "{failed} no_backend failures counted"
    );
    let seconds = started.elapsed().as_secs() + 1;
    let stderr = proxy.stderr();
    for line in ["no backend could be reached", "backend connect failed"] {
        let n = stderr.matches(line).count() as u64;
        ensure!(
            n <= seconds + 1,
            "{n} lines of {line:?} in {seconds}s for {CLIENTS} clients"
        );
    }
    Ok(())
}

/// What a proxy process holds, read from the kernel (`/proc/PID/fd`, `VmRSS`) and from its own
/// `/metrics` in between.
#[derive(Debug, Clone, Copy)]
struct Footprint {
    /// Entries of `/proc/PID/fd`: the smaller of a count just before and one just after the
    /// metrics were read (the admin connection serving them is in neither or only one).
    fds: i64,
    /// `open_fds` as the proxy counts itself.
    open_fds: f64,
    connections: f64,
    pipes_pooled: f64,
    rss: u64,
}

impl Footprint {
    /// Descriptors beyond its connections: each carried connection holds two (client and
    /// backend), each idle pooled splice pipe two; the rest is listeners, the runtime, the
    /// admin and handoff servers, and whatever leaked.
    fn beyond(&self) -> i64 {
        self.fds - 2 * self.connections as i64 - 2 * self.pipes_pooled as i64
    }
}

impl std::fmt::Display for Footprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} descriptors beyond connections ({} in /proc/PID/fd, open_fds {}, \
             {} connections active, {} splice pipes pooled), RSS {} KiB",
            self.beyond(),
            self.fds,
            self.open_fds,
            self.connections,
            self.pipes_pooled,
            self.rss / 1024
        )
    }
}

fn proc_fds(pid: u32) -> Result<i64> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .with_context(|| format!("read /proc/{pid}/fd"))?;
    Ok(dir.count() as i64)
}

/// The footprint of the instance `pid` answering on `admin` (a successor of an in-place
/// upgrade is no child of ours: it is reached by pid and admin address).
async fn footprint(pid: u32, admin: SocketAddr) -> Result<Footprint> {
    let before = proc_fds(pid)?;
    let (code, metrics) = kube_apiserver_proxy_tests::client::http_get(admin, "/metrics").await?;
    ensure!(code == 200, "/metrics answered {code}");
    let after = proc_fds(pid)?;
    let read = |name| require_metric(&metrics, name, &[]);
    Ok(Footprint {
        fds: before.min(after),
        open_fds: read("open_fds")?,
        connections: read("connections_active")?,
        pipes_pooled: read("splice_pipes_pooled")?,
        rss: rss(pid)?,
    })
}

/// The baseline of a serving instance: the smallest of a few footprints taken 100 ms apart
/// (each can include a health check or a peer's status request in flight; the smallest is
/// the instance at rest under its long-lived load), with the largest RSS seen among them.
async fn baseline(pid: u32, admin: SocketAddr) -> Result<Footprint> {
    let mut best = footprint(pid, admin).await?;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(100)).await; // spacing between samples
        let now = footprint(pid, admin).await?;
        if now.beyond() < best.beyond() {
            best = Footprint {
                rss: best.rss.max(now.rss),
                ..now
            };
        }
    }
    Ok(best)
}

/// Descriptors beyond connections may exceed the baseline by this much at the end: transient
/// sockets an instance at rest still opens — a health check's connection in flight (one every
/// 100 ms, each lives a few ms), the admin connection of the previous scrape not yet closed
/// on the proxy's side, a peer's or the test's handoff status request — at most one or two of
/// each at any instant. A leak of one descriptor per health check, per connection or per
/// handoff exceeds it by hundreds.
const FD_MARGIN: i64 = 4;

/// RSS may grow this much over a run: the allocator keeps freed memory (per-thread arenas,
/// caches of TLS sessions and buffers of thousands of connections that have come and gone)
/// and the first handoffs and upgrades touch code and data the baseline had not. A leak of the
/// order of a connection's buffers (tens of KiB) per connection, per check or per peer exceeds
/// it over thousands of connections and hundreds of checks.
const RSS_MARGIN: u64 = 16 << 20;

/// Waits until the instance's descriptors beyond connections and its RSS are back within the
/// margins of `base`, with no connection active (the load is over).
async fn back_within_margins(
    who: &str,
    pid: u32,
    admin: SocketAddr,
    base: Footprint,
) -> Result<Footprint> {
    eventually(Duration::from_secs(15), || async {
        let now = footprint(pid, admin).await?;
        ensure!(
            now.connections == 0.0,
            "{who}: {} connections still active after the load ended",
            now.connections
        );
        ensure!(
            now.beyond() <= base.beyond() + FD_MARGIN,
            "{who} leaks descriptors: {} beyond connections now, {} at the baseline \
             (margin {FD_MARGIN}); now: {now}; baseline: {base}",
            now.beyond(),
            base.beyond()
        );
        ensure!(
            now.rss <= base.rss + RSS_MARGIN,
            "{who} leaks memory: RSS {} KiB now, {} KiB at the baseline (margin {} KiB); \
             now: {now}; baseline: {base}",
            now.rss / 1024,
            base.rss / 1024,
            RSS_MARGIN / 1024
        );
        Ok(now)
    })
    .await
}

/// Long-lived `/watch` streams through a proxy (kubelets' and controllers' watches), each read
/// on its own task; a stream that breaks ends its task with the error.
struct Watches(Vec<tokio::task::JoinHandle<Result<()>>>);

impl Watches {
    async fn open(
        client: &kube_apiserver_proxy_tests::client::HttpsClient,
        addr: SocketAddr,
        n: usize,
    ) -> Result<Self> {
        let mut tasks = Vec::new();
        for _ in 0..n {
            let mut watch = client.watch(addr, "/watch?interval_ms=50").await?;
            watch.next_line(DEADLINE).await?;
            tasks.push(tokio::spawn(async move {
                loop {
                    watch.next_line(DEADLINE).await?;
                }
            }));
        }
        Ok(Watches(tasks))
    }

    /// Fails if a stream broke, else closes them all.
    async fn close(self, who: &str) -> Result<()> {
        if let Some(broken) = self.0.iter().position(|t| t.is_finished()) {
            let task = self.0.into_iter().nth(broken).context("broken watch")?;
            return match task.await? {
                Err(e) => Err(e.context(format!("a watch through {who} broke"))),
                Ok(()) => anyhow::bail!("a watch through {who} ended"),
            };
        }
        for task in self.0 {
            task.abort();
            let _ = task.await;
        }
        Ok(())
    }
}

/// A proxy that lives through many peers and in-place upgrades leaks nothing. Instance A
/// (https health checks every 100 ms against a TLS fake apiserver, `--handoff-dir`) serves
/// long-lived watches and a churn of short TLS requests while peers start one after another on
/// its address and handoff directory, share its listening sockets, become ready and are
/// stopped with SIGTERM (they drain; the sockets stay with A). Alongside, a second chain B is
/// upgraded in place (SIGUSR2) several times with its watches carried over. At the end, with
/// the load over, A's descriptors beyond its connections and its RSS are back to its baseline
/// within stated margins, and so are those of B's last instance against B's first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_lived_proxy_leaks_nothing_across_handoffs_and_upgrades() -> Result<()> {
    use crate::upgrade::{install_binary, upgrade, wait_gone, PidGuard};
    use kube_apiserver_proxy_tests::load::HttpsLoad;
    /// Peers started and stopped next to A.
    const PEERS: usize = 12;
    /// In-place upgrades of chain B (one after every fourth peer).
    const UPGRADES: usize = 3;
    /// Successful https checks of A's backend the run must include at least.
    const CHECKS: f64 = 300.0;
    let started = Instant::now();
    let pki = Pki::new()?;
    let backend = crate::https_backend(&pki).await?;
    let client = crate::https_client(&pki)?;
    let dir = TempDir::new("long-life")?;
    let handoff = dir.join("handoff");
    let listen = listen_addr()?;
    let instance = |listen| {
        crate::https_proxy(&pki, listen, &[&backend])
            .fast_health()
            .drain_timeout(DEADLINE)
    };
    let ready = |proxy: &Proxy| {
        let admin = proxy.admin_addr();
        async move {
            eventually(DEADLINE, || async {
                let (code, _) =
                    kube_apiserver_proxy_tests::client::http_get(admin, "/readyz").await?;
                ensure!(code == 200, "/readyz {code}");
                Ok(())
            })
            .await
        }
    };
    let a = serving(instance(listen).arg("--handoff-dir").arg(&handoff)).await?;
    ready(&a).await?;
    let a_cookies = listener_cookies(&a).await?;

    // Chain B: run from a copy of the binary (replaced before each upgrade), its own address
    // and handoff directory.
    std::fs::create_dir(dir.join("bin"))?;
    let bin = dir.join("bin").join("kube-apiserver-proxy");
    install_binary(&bin, "")?;
    let b_listen = listen_addr()?;
    let b_first = serving(
        instance(b_listen)
            .bin(&bin)
            .arg("--handoff-dir")
            .arg(dir.join("b-handoff")),
    )
    .await?;
    ready(&b_first).await?;
    let b_admin = b_first.admin_addr();

    let a_watches = Watches::open(&client, listen, 6).await?;
    let b_watches = Watches::open(&client, b_listen, 4).await?;
    let a_base = baseline(a.pid(), a.admin_addr()).await?;
    let b_base = baseline(b_first.pid(), b_admin).await?;
    ensure!(
        a_base.connections == 6.0 && b_base.connections == 4.0,
        "baseline: A carries {} connections, B {} (expected 6 and 4)",
        a_base.connections,
        b_base.connections
    );
    println!("baseline A: {a_base}\nbaseline B: {b_base}");

    let a_load = HttpsLoad::start(listen, client.clone(), 2);
    let b_load = HttpsLoad::start(b_listen, client.clone(), 1);
    a_load.wait_progress(20).await?;
    let mut b_pid = b_first.pid();
    let mut guards = Vec::new();
    for i in 0..PEERS {
        let peer = instance(listen)
            .arg("--handoff-dir")
            .arg(&handoff)
            .spawn()
            .await?;
        ready(&peer).await?;
        let shared = listener_cookies(&peer).await?;
        ensure!(
            shared == a_cookies,
            "peer {i} does not share A's listening sockets: {shared:?}, A's {a_cookies:?}"
        );
        a_load.wait_progress(10).await?;
        peer.sigterm()?;
        let status = peer.wait_exit(Duration::from_secs(15)).await?;
        ensure!(status.success(), "peer {i} exited with {status}");
        if i % 4 == 3 && guards.len() < UPGRADES {
            install_binary(&bin, &format!("\nupgrade {i}\n"))?;
            let next = upgrade(b_pid, b_admin).await?;
            guards.push(PidGuard(next));
            if b_pid == b_first.pid() {
                b_first.wait_exit(Duration::from_secs(30)).await?;
            } else {
                wait_gone(b_pid).await?;
            }
            b_pid = next;
            b_load.wait_progress(5).await?;
        }
    }
    ensure!(guards.len() == UPGRADES, "{} upgrades of B", guards.len());
    // Several hundred checks in all: keep the load on until A has done them.
    let a_backend = backend.addr().to_string();
    let checks = eventually(Duration::from_secs(60), || async {
        let ok = a
            .metric_or_zero(
                "health_checks_total",
                &[("backend", &a_backend), ("result", "ok")],
            )
            .await?;
        ensure!(
            ok >= CHECKS,
            "A has done {ok} https checks, waiting for {CHECKS}"
        );
        Ok(ok)
    })
    .await?;
    let (a_ok, a_failed) = a_load.stop().await;
    let (b_ok, b_failed) = b_load.stop().await;
    a_watches.close("A").await?;
    b_watches.close("B").await?;
    let a_now = listener_cookies(&a).await?;
    ensure!(
        a_now == a_cookies,
        "A's listening sockets changed: {a_now:?}, at its start {a_cookies:?}"
    );
    let a_end = back_within_margins("A", a.pid(), a.admin_addr(), a_base).await?;
    let b_end = back_within_margins("B's last instance", b_pid, b_admin, b_base).await?;
    println!(
        "{PEERS} peers next to A and {UPGRADES} in-place upgrades of B in {:.1}s; A: {checks} \
         https checks ok, {a_ok} requests ok, {} failed; B: {b_ok} ok, {} failed\n\
         end A: {a_end}\nend B: {b_end}",
        started.elapsed().as_secs_f64(),
        a_failed.len(),
        b_failed.len()
    );
    Ok(())
}
