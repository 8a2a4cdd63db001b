//! Lifecycle and drain: SIGTERM stops accepting at once, in-flight requests finish, long
//! streams are cut at `--drain-timeout` (spread over `--drain-close-window`), exit code 0;
//! each state is logged once.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::util::{connection_refused, eventually};

use crate::{
    connect_echo, echo_backend, https_backend, https_client, https_proxy, listen_addr, serving,
    tcp_proxy, DEADLINE,
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
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(tcp_proxy(listen, &[&backend]).fast_health()).await?;
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
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(tcp_proxy(listen, &[&backend]).fast_health().args([
        "--drain-timeout",
        "500ms",
        "--drain-close-window",
        "1s",
    ]))
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
