//! The kernel data path (`--data-path=sockmap`): paired sockets, bytes moved by the kernel.
//! Bytes arrive intact both ways, half-close propagates after the bytes before it, TLS works
//! end to end (the client speaks first, before the pair exists), the drain deadline cuts
//! paired connections like others, byte counters include what the kernel moved, and without
//! the privileges the proxy falls back to copying in user space. An in-place upgrade leaves
//! paired connections with the old instance, which drains them.

use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::TcpClient;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::load::Load;
use kube_apiserver_proxy_tests::proxy::Proxy;
use kube_apiserver_proxy_tests::streams::Streams;
use kube_apiserver_proxy_tests::util::{eventually, is_root, skip};
use rand::RngCore as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::upgrade::{upgrade, PidGuard, Upgradable, UPGRADE_DEADLINE};
use crate::{
    connect_echo, echo_backend, https_backend, https_client, https_proxy, listen_addr, serving,
    tcp_proxy, DEADLINE,
};

const KERNEL_PATH: &str = "--data-path=sockmap";

/// Loading the BPF program needs CAP_BPF and CAP_NET_ADMIN: root here.
fn can_run(test: &str) -> Option<Result<()>> {
    if is_root() {
        None
    } else {
        Some(skip(
            test,
            "the kernel data path needs root (CAP_BPF, CAP_NET_ADMIN)",
        ))
    }
}

/// The proxy set the kernel path up, and `paired` connections at least went through it.
async fn paired_at_least(proxy: &Proxy, paired: f64) -> Result<()> {
    let active = proxy.metric_or_zero("sockmap_active", &[]).await?;
    ensure!(
        active == 1.0,
        "sockmap_active = {active}: the kernel path was not set up:\n{}",
        proxy.stderr()
    );
    eventually(DEADLINE, || async {
        let n = proxy
            .metric_or_zero("sockmap_connections_total", &[("result", "paired")])
            .await?;
        ensure!(
            n >= paired,
            "sockmap_connections_total{{paired}} = {n}, want >= {paired}"
        );
        Ok(())
    })
    .await
}

/// A backend that sends a large answer at once and closes (`logs` of a big container, a large
/// LIST) to a client that does not read for longer than the kernel path's flush limit: the
/// backend's EOF is seen while most of the answer waits for the client, and the half-close
/// must wait for all of it, however long the client takes, while its connection is open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_path_waits_for_a_slow_reader_before_the_half_close() -> Result<()> {
    if let Some(r) = can_run("kernel_path_waits_for_a_slow_reader_before_the_half_close") {
        return r;
    }
    const ANSWER: usize = 16 << 20;
    let mut answer = vec![0u8; ANSWER];
    rand::thread_rng().fill_bytes(&mut answer);
    let answer = std::sync::Arc::new(answer);
    let backend = tokio::net::TcpListener::bind(
        kube_apiserver_proxy_tests::util::free_random_loopback_addr()?,
    )
    .await?;
    let backend_addr = backend.local_addr()?;
    let dump = answer.clone();
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = backend.accept().await else {
                return;
            };
            let dump = dump.clone();
            // Health checks connect and close: their writes fail, which is fine.
            tokio::spawn(async move {
                let _ = s.write_all(&dump).await;
                let _ = s.shutdown().await;
            });
        }
    });
    let listen = listen_addr()?;
    let proxy = serving(
        kube_apiserver_proxy_tests::proxy::ProxyBuilder::new()
            .listen(listen)
            .backend(backend_addr)
            .health_check("tcp")
            .fast_health()
            .arg(KERNEL_PATH),
    )
    .await?;
    let client = TcpClient::connect(listen).await?;
    let mut stream = client.into_inner();
    // Longer than the flush limit (10 s) without reading a byte.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let mut back = Vec::with_capacity(ANSWER);
    tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut back)).await??;
    server.abort();
    ensure!(
        back.len() == ANSWER,
        "got {} of {ANSWER} bytes:\n{}",
        back.len(),
        proxy.stderr()
    );
    ensure!(back == *answer, "the bytes differ from the answer");
    paired_at_least(&proxy, 1.0).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_path_moves_large_payloads_byte_exact_and_counts_them() -> Result<()> {
    if let Some(r) = can_run("kernel_path_moves_large_payloads_byte_exact_and_counts_them") {
        return r;
    }
    const PAYLOAD: usize = 4 << 20;
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(
        tcp_proxy(listen, &[&backend])
            .fast_health()
            .arg(KERNEL_PATH),
    )
    .await?;
    let mut tasks = Vec::new();
    let mut sent = Vec::new();
    for _ in 0..3 {
        let mut data = vec![0u8; PAYLOAD];
        rand::thread_rng().fill_bytes(&mut data);
        sent.push(data.clone());
        tasks.push(tokio::spawn(async move {
            let client = TcpClient::connect(listen).await?;
            let (mut reader, mut writer) = client.into_inner().into_split();
            let write = tokio::spawn(async move {
                writer.write_all(&data).await?;
                writer.shutdown().await?;
                anyhow::Ok(())
            });
            let mut back = Vec::with_capacity(PAYLOAD);
            tokio::time::timeout(Duration::from_secs(30), reader.read_to_end(&mut back)).await??;
            write.await??;
            anyhow::Ok(back)
        }));
    }
    for (task, sent) in tasks.into_iter().zip(&sent) {
        let back = task.await??;
        ensure!(
            back.len() == sent.len(),
            "got {} of {} bytes",
            back.len(),
            sent.len()
        );
        ensure!(&back == sent, "echoed bytes differ from sent bytes");
    }
    paired_at_least(&proxy, 3.0).await?;
    let total = (3 * PAYLOAD) as f64;
    eventually(DEADLINE, || async {
        let up = proxy
            .metric_or_zero("bytes_total", &[("direction", "client_to_backend")])
            .await?;
        let down = proxy
            .metric_or_zero("bytes_total", &[("direction", "backend_to_client")])
            .await?;
        // The health checks' connections are not counted; the echo check round trips are.
        ensure!(
            up >= total && down >= total && up < total + 1e6 && down < total + 1e6,
            "bytes_total client_to_backend {up}, backend_to_client {down}, want about {total}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn kernel_path_half_close_follows_the_bytes_before_it() -> Result<()> {
    if let Some(r) = can_run("kernel_path_half_close_follows_the_bytes_before_it") {
        return r;
    }
    let backend = FakeApiserver::tcp_sink().random_loopback()?.start().await?;
    let listen = listen_addr()?;
    let proxy = serving(
        tcp_proxy(listen, &[&backend])
            .fast_health()
            .arg(KERNEL_PATH),
    )
    .await?;
    for _ in 0..3 {
        let mut client = TcpClient::connect(listen).await?;
        client.write_all(&vec![b'x'; 8 << 20]).await?;
        client.shutdown_write().await?;
        // The sink answers with the count only after EOF: the answer proves both halves and
        // that the FIN did not overtake bytes still queued in the kernel.
        let answer = client.read_to_end(DEADLINE).await?;
        ensure!(
            answer == b"8388608\n",
            "expected the byte count after EOF, got {:?}",
            String::from_utf8_lossy(&answer)
        );
    }
    ensure!(backend.eofs() == 3, "backend saw {} EOFs", backend.eofs());
    paired_at_least(&proxy, 3.0).await
}

/// TLS end to end: the client's hello is sent before the pair exists and must be moved
/// without waiting for more; a watch streams through the kernel path until the drain deadline
/// cuts it, and the proxy exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_path_carries_tls_and_is_cut_at_the_drain_deadline() -> Result<()> {
    if let Some(r) = can_run("kernel_path_carries_tls_and_is_cut_at_the_drain_deadline") {
        return r;
    }
    let pki = Pki::new()?;
    let backend = https_backend(&pki).await?;
    let listen = listen_addr()?;
    let proxy = serving(https_proxy(&pki, listen, &[&backend]).fast_health().args([
        KERNEL_PATH,
        "--drain-timeout",
        "2s",
        "--drain-close-window",
        "200ms",
    ]))
    .await?;
    let client = https_client(&pki)?;
    let (status, body) = tokio::time::timeout(DEADLINE, client.get(listen, "/version")).await??;
    ensure!(
        status == 200,
        "/version through the kernel path: {status} {body}"
    );
    let mut watch = client.watch(listen, "/watch?interval_ms=50").await?;
    watch.next_line(Duration::from_secs(5)).await?;
    paired_at_least(&proxy, 2.0).await?;
    let term_at = Instant::now();
    proxy.sigterm()?;
    let lines = watch.wait_cut(Duration::from_secs(6)).await?;
    let cut_after = term_at.elapsed();
    ensure!(
        cut_after >= Duration::from_millis(1800),
        "watch cut {cut_after:?} after SIGTERM, before --drain-timeout 2s"
    );
    ensure!(lines >= 10, "only {lines} watch lines during the drain");
    let status = proxy.wait_exit(Duration::from_secs(5)).await?;
    ensure!(status.code() == Some(0), "exit {status}");
    Ok(())
}

/// Without CAP_BPF and CAP_NET_ADMIN (another uid), the proxy says so once and copies in user
/// space.
#[tokio::test]
async fn kernel_path_falls_back_to_user_space_without_privileges() -> Result<()> {
    if let Some(r) = can_run("kernel_path_falls_back_to_user_space_without_privileges") {
        return r;
    }
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(
        tcp_proxy(listen, &[&backend])
            .fast_health()
            .arg(KERNEL_PATH)
            .run_as(65534),
    )
    .await?;
    connect_echo(listen).await?;
    ensure!(
        proxy.metric_or_zero("sockmap_active", &[]).await? == 0.0,
        "sockmap_active without privileges"
    );
    let stderr = proxy.stderr();
    ensure!(
        stderr.contains("sockmap unavailable")
            && stderr.matches("sockmap unavailable").count() == 1,
        "the fallback is not logged once:\n{stderr}"
    );
    ensure!(
        proxy
            .metric_or_zero("bytes_total", &[("direction", "client_to_backend")])
            .await?
            >= 5.0,
        "bytes not counted on the fallback path"
    );
    Ok(())
}

/// An in-place upgrade (SIGUSR2) does not hand over connections paired in the kernel (the bytes
/// queued for redirection cannot be read out): the old instance declines to park them, keeps
/// them flowing until they end and then exits 0, while the successor takes the listening socket
/// and the new connections. No stream fails, no request fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_path_connections_stay_with_the_old_instance_at_an_upgrade() -> Result<()> {
    if let Some(r) = can_run("kernel_path_connections_stay_with_the_old_instance_at_an_upgrade") {
        return r;
    }
    let backend = FakeApiserver::tcp_echo().start().await?;
    let listen = listen_addr()?;
    let up = Upgradable::start(listen, backend.addr(), |b| {
        b.drain_timeout(Duration::from_secs(120)).arg(KERNEL_PATH)
    })
    .await?;
    let streams = Streams::start(listen, 8, Duration::from_millis(10), |i| {
        if i % 4 == 0 {
            8192
        } else {
            1
        }
    })
    .await?;
    paired_at_least(&up.first, 8.0).await?;
    let load = Load::start(listen, 4);
    let next = upgrade(up.first.pid(), up.first.admin_addr()).await?;
    let _guard = PidGuard(next);
    // The streams go on through the old instance, which stays for them.
    let words = streams.words();
    eventually(UPGRADE_DEADLINE, || async {
        ensure!(
            streams.words() > words + 10_000,
            "streams stalled after the upgrade"
        );
        Ok(())
    })
    .await?;
    up.first
        .ensure_running()
        .context("the old instance left its paired connections")?;
    ensure!(streams.failed() == 0, "a stream failed at the upgrade");
    let report = streams.stop().await;
    let status = up.first.wait_exit(UPGRADE_DEADLINE).await?;
    ensure!(status.success(), "old instance: {status}");
    let churn = load.stop().await;
    println!("streams {}; churn {}", report.summary(), churn.summary());
    ensure!(report.failures.is_empty(), "{:?}", report.failures);
    ensure!(
        churn.failures.is_empty() && churn.ok > 0,
        "{}",
        churn.summary()
    );
    Ok(())
}
