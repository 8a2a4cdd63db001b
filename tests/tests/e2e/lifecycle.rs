//! Lifecycle and drain: SIGTERM stops accepting at once, in-flight requests finish, long
//! streams are cut at `--drain-timeout` (spread over `--drain-close-window`), exit code 0;
//! each state is logged once.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::util::{connection_refused, eventually};

use crate::{
    connect_echo, echo_backend, echo_proxy, echo_proxy_with, https_backend, https_client,
    https_proxy, listen_addr, serving, tcp_proxy, DEADLINE,
};

const STATES: [&str; 5] = [
    "Starting",
    "WaitingForBackend",
    "Serving",
    "Draining",
    "Stopped",
];

/// Lines of the lifecycle log that announce `state` (`state=X` or `state="X"`).
fn lifecycle_lines(stderr: &str, state: &str) -> usize {
    let plain = format!("state={state}");
    let quoted = format!("state=\"{state}\"");
    stderr
        .lines()
        .filter(|line| line.contains("lifecycle"))
        .filter(|line| {
            line.split_whitespace()
                .any(|word| word == plain || word == quoted)
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_and_exits_zero() -> Result<()> {
    let pki = Pki::new()?;
    let backend = https_backend(&pki).await?;
    let listen = listen_addr()?;
    let proxy = serving(https_proxy(&pki, listen, &[&backend]).fast_health().args([
        "--drain-timeout",
        "2s",
        "--drain-close-window",
        "200ms",
    ]))
    .await?;
    let client = https_client(&pki)?;
    let mut watch = client.watch(listen, "/watch?interval_ms=50").await?;
    watch.next_line(Duration::from_secs(5)).await?;
    let mut keepalive = client.connect(listen).await?;
    ensure!(
        keepalive.get("/version").await?.0 == 200,
        "keep-alive /version"
    );
    let slow = {
        let client = client.clone();
        tokio::spawn(async move { client.get(listen, "/slow?ms=700").await })
    };
    eventually(Duration::from_secs(5), || async {
        ensure!(
            backend.requests("/slow") == 1,
            "slow request not at the backend yet"
        );
        Ok(())
    })
    .await?;

    let term_at = Instant::now();
    proxy.sigterm()?;

    // Stop accepting at once.
    eventually(Duration::from_secs(1), || async {
        ensure!(
            connection_refused(listen).await,
            "{listen} still accepts after SIGTERM"
        );
        Ok(())
    })
    .await?;
    // Not ready while draining.
    eventually(Duration::from_secs(1), || async {
        let (status, _) = proxy.admin_get("/readyz").await?;
        ensure!(status == 503, "/readyz = {status} while draining");
        Ok(())
    })
    .await?;
    // The in-flight request completes; the established connection still carries requests.
    let (status, body) = slow.await??;
    ensure!(
        status == 200 && body == "slow done",
        "in-flight request: {status} {body}"
    );
    ensure!(
        keepalive.get("/version").await?.0 == 200,
        "keep-alive /version while draining"
    );
    // The stream lives on until the drain deadline, then it is cut.
    let lines = watch.wait_cut(Duration::from_secs(6)).await?;
    let cut_after = term_at.elapsed();
    ensure!(
        cut_after >= Duration::from_millis(1800),
        "watch cut {cut_after:?} after SIGTERM, before --drain-timeout 2s"
    );
    ensure!(
        cut_after <= Duration::from_millis(3500),
        "watch cut only {cut_after:?} after SIGTERM (drain-timeout 2s + window 200ms)"
    );
    ensure!(lines >= 10, "only {lines} watch lines during the drain");

    let status = proxy.wait_exit(Duration::from_secs(5)).await?;
    ensure!(status.code() == Some(0), "exit {status}");
    let stderr = proxy.stderr();
    for state in STATES {
        let n = lifecycle_lines(&stderr, state);
        ensure!(
            n == 1,
            "state {state} logged {n} times (want once):\n{stderr}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn sigint_without_connections_exits_zero_promptly() -> Result<()> {
    let (_backend, listen, proxy) = echo_proxy().await?;
    connect_echo(listen).await?;
    eventually(Duration::from_secs(5), || async {
        let active = proxy.metric_or_zero("connections_active", &[]).await?;
        ensure!(active == 0.0, "connections_active = {active}");
        Ok(())
    })
    .await?;
    let start = Instant::now();
    proxy.sigint()?;
    let status = proxy.wait_exit(Duration::from_secs(5)).await?;
    ensure!(status.code() == Some(0), "exit {status}");
    ensure!(
        start.elapsed() < Duration::from_secs(3),
        "idle proxy took {:?} to stop",
        start.elapsed()
    );
    ensure!(
        connection_refused(listen).await,
        "{listen} accepts after exit"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_closes_remaining_connections_spread_over_the_window() -> Result<()> {
    let (_backend, listen, proxy) =
        echo_proxy_with(|b| b.args(["--drain-timeout", "500ms", "--drain-close-window", "1s"]))
            .await?;
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(connect_echo(listen).await?);
    }
    let term_at = Instant::now();
    proxy.sigterm()?;
    let waits: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            tokio::spawn(async move {
                client.wait_closed(Duration::from_secs(5)).await?;
                anyhow::Ok(term_at.elapsed())
            })
        })
        .collect();
    let mut cut = Vec::new();
    for wait in waits {
        cut.push(wait.await??);
    }
    let first = *cut.iter().min().expect("8 clients");
    let last = *cut.iter().max().expect("8 clients");
    ensure!(
        first >= Duration::from_millis(400),
        "a connection was cut {first:?} after SIGTERM, before --drain-timeout 500ms"
    );
    ensure!(
        last - first >= Duration::from_millis(200),
        "8 connections cut within {:?}: not spread over the 1s window ({cut:?})",
        last - first
    );
    ensure!(
        last <= Duration::from_millis(2500),
        "last cut after {last:?}"
    );
    let status = proxy.wait_exit(Duration::from_secs(5)).await?;
    ensure!(status.code() == Some(0), "exit {status}");
    Ok(())
}

/// A SIGTERM that arrives while the process is still starting (before any backend is healthy)
/// is a clean shutdown, not a death by signal: the handlers are installed first thing.
#[tokio::test]
async fn sigterm_during_startup_exits_zero() -> Result<()> {
    use std::os::unix::process::ExitStatusExt as _;
    for _ in 0..5 {
        let listen = listen_addr()?;
        // A backend that never answers keeps the instance in WaitingForBackend.
        let proxy = kube_apiserver_proxy_tests::proxy::ProxyBuilder::new()
            .listen(listen)
            .backend(kube_apiserver_proxy_tests::util::free_random_loopback_addr()?)
            .health_check("tcp")
            .spawn_raw()?;
        // Wait only until the first log line ("state=Starting"): the earliest sign of life.
        eventually(DEADLINE, || async {
            ensure!(!proxy.stderr().is_empty(), "no output yet");
            Ok(())
        })
        .await?;
        proxy.sigterm()?;
        let status = proxy.wait_exit(DEADLINE).await?;
        ensure!(
            status.code() == Some(0),
            "exit {status} (signal {:?}); stderr:\n{}",
            status.signal(),
            proxy.stderr()
        );
    }
    Ok(())
}

/// A backend that answers once and then resets the connection (closes it with `SO_LINGER` 0,
/// as a kernel does for a socket closed with unread bytes: kube-apiserver closing a connection
/// after its GOAWAY while the client's next frames are still arriving). Returns its address.
async fn answer_then_reset() -> Result<std::net::SocketAddr> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                if stream.read(&mut buf).await.unwrap_or(0) == 0 {
                    return;
                }
                let _ = stream.write_all(b"last answer\n").await;
                // Gone only after the answer left (the client's bytes keep arriving unread).
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = socket2::SockRef::from(&stream).set_linger(Some(Duration::ZERO));
            });
        }
    });
    Ok(addr)
}

/// A backend that closes its connection with a reset while the client is still sending: the
/// client gets the backend's last answer and then an orderly end of stream (FIN) from the
/// proxy, not a reset. The proxy used to drop both sockets at the first error of either
/// direction; closing the client's socket with its bytes unread sent the client a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_reset_reaches_the_client_as_an_orderly_close() -> Result<()> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let backend = answer_then_reset().await?;
    let listen = listen_addr()?;
    let proxy = serving(kube_apiserver_proxy_tests::proxy::ProxyBuilder::tcp(
        listen, backend,
    ))
    .await?;
    for round in 0..5 {
        let stream = tokio::net::TcpStream::connect(listen).await?;
        let (mut read, mut write) = stream.into_split();
        // The client writes on, as fast as it can (the backend reads no more: the bytes pile
        // up in the buffers on the way, unread), until it sees the end.
        let writer = tokio::spawn(async move {
            for _ in 0..20_000 {
                if write.write_all(&[b'x'; 512]).await.is_err() {
                    break;
                }
            }
            write
        });
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let end = tokio::time::timeout(DEADLINE, async {
            loop {
                match read.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => return Err(e),
                }
            }
        })
        .await?;
        writer.abort();
        ensure!(
            got == b"last answer\n",
            "round {round}: got {:?}",
            String::from_utf8_lossy(&got)
        );
        if let Err(e) = end {
            anyhow::bail!(
                "round {round}: the client saw {e} after the last answer, not an orderly end"
            );
        }
    }
    proxy.ensure_running()?;
    Ok(())
}

/// A client that a draining instance accepted but can no longer carry (its only backend
/// stopped listening, no other known: an instance configured with its own apiserver alone)
/// is carried to the successor that adopted the listening socket, instead of being closed
/// once --connect-timeout runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_client_of_a_draining_instance_reaches_the_successor() -> Result<()> {
    use kube_apiserver_proxy_tests::client::TcpClient;
    use kube_apiserver_proxy_tests::util::TempDir;
    let old_backend = echo_backend().await?;
    let new_backend = echo_backend().await?;
    let dir = TempDir::new("held-to-successor")?;
    let listen = listen_addr()?;
    let old = serving(
        tcp_proxy(listen, &[&old_backend])
            .fast_health()
            .arg("--handoff-dir")
            .arg(dir.join("handoff"))
            .arg("--connect-timeout=20s"),
    )
    .await?;
    // The old pod's apiserver closes its listener (SIGTERM, no shutdown delay).
    old_backend.stop_listening().await;
    // A client arrives: only the old instance accepts; it holds the client (no backend).
    let mut client = TcpClient::connect(listen).await?;
    eventually(DEADLINE, || async {
        ensure!(
            old.metric_or_zero("connections_active", &[]).await? >= 1.0,
            "the client is not held yet"
        );
        Ok(())
    })
    .await?;
    // The successor starts (sharing the socket), then the old instance is stopped: it hands
    // the socket over, and the held client goes on to the successor.
    let _new = serving(
        tcp_proxy(listen, &[&new_backend])
            .fast_health()
            .arg("--handoff-dir")
            .arg(dir.join("handoff")),
    )
    .await?;
    let started = Instant::now();
    old.sigterm()?;
    client.round_trip(b"hello").await?;
    ensure!(
        started.elapsed() < Duration::from_secs(10),
        "the held client was answered only after {:?}",
        started.elapsed()
    );
    ensure!(
        new_backend.accepted() >= 1,
        "the successor's backend got nothing"
    );
    old.wait_stderr("client carried to the successor").await?;
    Ok(())
}
