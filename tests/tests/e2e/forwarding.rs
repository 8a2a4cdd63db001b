//! Forwarding: byte-exact both ways at once, TLS with client certificates end to end,
//! half-close, no idle timeout, `--max-connections`, IPv6 listen addresses, no self-wake-up per
//! connection.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::{HttpsClient, TcpClient};
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::proxy::ProxyBuilder;
use kube_apiserver_proxy_tests::sockets::tcp_connections;
use kube_apiserver_proxy_tests::util::{eventually, free_addr, ipv6_loopback_available};
use rand::RngCore as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::{
    connect_echo, echo_backend, echo_proxy, echo_proxy_with, https_backend_requiring_client_cert,
    listen_addr, serving, tcp_proxy, DEADLINE,
};

const PAYLOAD: usize = 4 * 1024 * 1024;

/// Sends `data` while reading the echo concurrently; returns what came back.
async fn echo_concurrently(addr: SocketAddr, data: Vec<u8>) -> Result<Vec<u8>> {
    let client = TcpClient::connect(addr).await?;
    let (mut reader, mut writer) = client.into_inner().into_split();
    let write = tokio::spawn(async move {
        writer.write_all(&data).await?;
        writer.shutdown().await?;
        anyhow::Ok(())
    });
    let mut back = Vec::with_capacity(PAYLOAD);
    tokio::time::timeout(Duration::from_secs(30), reader.read_to_end(&mut back))
        .await
        .context("echo did not finish within 30s")??;
    write.await??;
    Ok(back)
}

/// The default: buffered while bursts are small, splice once they are bulk (both paths run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_both_directions_are_byte_exact_auto() -> Result<()> {
    large_payloads_both_directions_are_byte_exact("auto").await
}

/// Zero-copy only (`--copy-mode=splice`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_both_directions_are_byte_exact_with_splice() -> Result<()> {
    large_payloads_both_directions_are_byte_exact("splice").await
}

/// The buffered path only (`--copy-mode=buffered`; also the fallback when no pipe can be had).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_payloads_both_directions_are_byte_exact_buffered() -> Result<()> {
    large_payloads_both_directions_are_byte_exact("buffered").await
}

async fn large_payloads_both_directions_are_byte_exact(mode: &str) -> Result<()> {
    let (_backend, listen, proxy) =
        echo_proxy_with(|b| b.arg(format!("--copy-mode={mode}"))).await?;
    let payloads: Vec<Vec<u8>> = (0..2)
        .map(|_| {
            let mut data = vec![0u8; PAYLOAD];
            rand::thread_rng().fill_bytes(&mut data);
            data
        })
        .collect();
    let tasks: Vec<_> = payloads
        .iter()
        .map(|data| tokio::spawn(echo_concurrently(listen, data.clone())))
        .collect();
    for (task, sent) in tasks.into_iter().zip(&payloads) {
        let back = task.await??;
        ensure!(
            back.len() == sent.len(),
            "got {} of {} bytes",
            back.len(),
            sent.len()
        );
        ensure!(&back == sent, "echoed bytes differ from sent bytes");
    }
    let total = (2 * PAYLOAD) as f64;
    eventually(DEADLINE, || async {
        let up = proxy
            .metric_or_zero("bytes_total", &[("direction", "client_to_backend")])
            .await?;
        let down = proxy
            .metric_or_zero("bytes_total", &[("direction", "backend_to_client")])
            .await?;
        ensure!(
            up >= total && down >= total,
            "bytes_total client_to_backend {up}, backend_to_client {down}, want >= {total}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn tls_with_client_certificate_end_to_end() -> Result<()> {
    let pki = Pki::new()?;
    let backend = https_backend_requiring_client_cert(&pki).await?;
    let listen = listen_addr()?;
    let _proxy = serving(
        crate::https_proxy(&pki, listen, &[&backend])
            .fast_health()
            .health_client_cert(pki.client_cert_file(), pki.client_key_file()),
    )
    .await?;
    let client = HttpsClient::new(pki.client_config(true)?);
    let (status, body) = client.get(listen, "/version").await?;
    ensure!(status == 200, "/version: {status} {body}");
    let version: serde_json::Value = serde_json::from_str(&body)?;
    ensure!(version["gitVersion"] == "v1.31.0-fake", "{version}");
    let (status, body) = client
        .post(listen, "/echo", b"through the proxy".to_vec())
        .await?;
    ensure!(
        status == 200 && body == "through the proxy",
        "{status} {body}"
    );
    // The backend really requires the client certificate: without one it fails.
    let anonymous = HttpsClient::new(pki.client_config(false)?);
    ensure!(
        anonymous.get(listen, "/version").await.is_err(),
        "a client without certificate got an answer"
    );
    Ok(())
}

#[tokio::test]
async fn half_close_propagates_with_splice() -> Result<()> {
    half_close_propagates("splice").await
}

#[tokio::test]
async fn half_close_propagates_buffered() -> Result<()> {
    half_close_propagates("buffered").await
}

async fn half_close_propagates(mode: &str) -> Result<()> {
    let backend = FakeApiserver::tcp_sink().random_loopback()?.start().await?;
    let listen = listen_addr()?;
    let _proxy = serving(
        tcp_proxy(listen, &[&backend])
            .fast_health()
            .arg(format!("--copy-mode={mode}")),
    )
    .await?;
    let mut client = TcpClient::connect(listen).await?;
    client.write_all(&vec![b'x'; 1 << 20]).await?;
    client.shutdown_write().await?;
    // The sink answers only after it has read EOF, so the answer proves both halves.
    let answer = client.read_to_end(DEADLINE).await?;
    ensure!(
        answer == b"1048576\n",
        "expected the byte count after EOF, got {:?}",
        String::from_utf8_lossy(&answer)
    );
    ensure!(backend.eofs() == 1, "backend saw {} EOFs", backend.eofs());
    Ok(())
}

/// How long the idle connection below stays idle: longer than any timeout an operator might
/// expect by default (and than the keepalive idle time, so keepalive probes flow meanwhile).
const IDLE: Duration = Duration::from_secs(5 * 60 + 5);

/// No idle timeout: a connection through the proxy with no traffic at all for over five
/// minutes (watches, `logs -f` and `exec` idle for longer) still carries bytes afterwards.
/// Keepalive is on on the client side (that, not a timeout, finds dead peers); the backend here
/// is on loopback, where `TCP_USER_TIMEOUT` is set instead (keepalive finds nothing there).
/// Runs in `cargo test --workspace`, in parallel with the rest.
#[tokio::test]
async fn idle_connection_is_not_timed_out() -> Result<()> {
    let (backend, listen, proxy) = echo_proxy().await?;
    let mut client = connect_echo(listen).await?;
    let client_addr = client.stream().local_addr()?;
    let sockets = tcp_connections(proxy.pid())?;
    let client_side = sockets
        .iter()
        .find(|s| s.peer == client_addr)
        .context("proxy has no socket for the client")?;
    let backend_side = sockets
        .iter()
        .find(|s| s.peer == backend.addr())
        .context("proxy has no socket to the backend")?;
    ensure!(
        client_side.keepalive && !backend_side.user_timeout.is_zero(),
        "dead-peer detection off: {client_side:?} {backend_side:?}"
    );
    let started = std::time::Instant::now();
    // Idle: no byte either way. Meanwhile the proxy must keep holding both sockets.
    while started.elapsed() < IDLE {
        let held = tcp_connections(proxy.pid())?;
        ensure!(
            held.iter().any(|s| s.peer == client_addr)
                && held.iter().any(|s| s.peer == backend.addr()),
            "the proxy dropped the idle connection after {:?}",
            started.elapsed()
        );
        ensure!(
            backend.active_sessions() == 1,
            "backend session gone after {:?}",
            started.elapsed()
        );
        tokio::time::sleep(Duration::from_secs(10).min(IDLE.saturating_sub(started.elapsed())))
            .await;
    }
    client.round_trip(b"still here after idling").await?;
    ensure!(
        backend.active_sessions() == 1,
        "sessions {}",
        backend.active_sessions()
    );
    Ok(())
}

#[tokio::test]
async fn max_connections_is_enforced() -> Result<()> {
    let (backend, listen, proxy) = echo_proxy_with(|b| b.args(["--max-connections", "2"])).await?;
    let mut first = connect_echo(listen).await?;
    let mut second = connect_echo(listen).await?;
    // Further clients are accepted and closed at once.
    for _ in 0..3 {
        let mut extra = TcpClient::connect(listen).await?;
        let _ = extra.write_all(b"let me in").await;
        extra
            .wait_closed(Duration::from_secs(2))
            .await
            .context("connection over --max-connections not closed at once")?;
    }
    // The admitted ones are unaffected.
    first.round_trip(b"first ok").await?;
    second.round_trip(b"second ok").await?;
    ensure!(
        backend.active_sessions() == 2,
        "sessions {}",
        backend.active_sessions()
    );
    eventually(DEADLINE, || async {
        let refused = proxy
            .metric_or_zero("connections_failed_total", &[("reason", "max_connections")])
            .await?;
        ensure!(
            refused >= 3.0,
            "connections_failed_total{{reason=max_connections}} = {refused}"
        );
        Ok(())
    })
    .await?;
    // A slot frees up when a client leaves.
    drop(first);
    let mut third = connect_echo(listen).await?;
    third.round_trip(b"third ok").await?;
    Ok(())
}

#[tokio::test]
async fn ipv6_listen_address() -> Result<()> {
    if !ipv6_loopback_available() {
        return kube_apiserver_proxy_tests::util::skip(
            "ipv6_listen_address",
            "[::1] not available",
        );
    }
    let backend = echo_backend().await?;
    let listen = free_addr("::1".parse()?)?;
    let _proxy = serving(ProxyBuilder::tcp(listen, backend.addr())).await?;
    let mut client = connect_echo(listen).await?;
    client.round_trip(b"over ipv6").await?;
    Ok(())
}

/// Client side: every option (inherited from the listener). Backend side, on loopback:
/// `TCP_NODELAY` and `TCP_USER_TIMEOUT`, and no keepalive, which cannot find a dead peer there
/// (the kernel answers probes for any open socket, and closes those of a process that dies).
#[tokio::test]
async fn keepalive_user_timeout_and_nodelay_on_both_sides() -> Result<()> {
    let (backend, listen, proxy) = echo_proxy().await?;
    let mut client = connect_echo(listen).await?;
    let client_addr = client.stream().local_addr()?;
    let backend_side_addr = backend.session_peers()[0];
    let sockets = tcp_connections(proxy.pid())?;
    let find = |addr: SocketAddr| {
        sockets
            .iter()
            .find(|s| s.peer == addr || s.local == addr)
            .with_context(|| format!("no proxy socket for {addr}: {sockets:#?}"))
    };
    for (side, socket) in [
        ("client", find(client_addr)?),
        ("backend", find(backend_side_addr)?),
    ] {
        ensure!(
            socket.nodelay,
            "{side} side: TCP_NODELAY not set: {socket:?}"
        );
        ensure!(
            socket.keepalive == (side == "client"),
            "{side} side: SO_KEEPALIVE {}: {socket:?}",
            if socket.keepalive {
                "set on loopback"
            } else {
                "not set"
            }
        );
        ensure!(
            !socket.user_timeout.is_zero(),
            "{side} side: TCP_USER_TIMEOUT not set: {socket:?}"
        );
    }
    client.round_trip(b"inspected").await?;
    Ok(())
}

/// Writes to the proxy's event-loop eventfds so far: each eventfd's counter (`eventfd-count`
/// in `/proc/PID/fdinfo`; tokio never reads it back, so it counts every wake-up by write).
fn eventfd_writes(pid: u32) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().contains("eventfd") {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            entry.file_name().to_string_lossy()
        ))?;
        let count = info
            .lines()
            .find_map(|l| l.strip_prefix("eventfd-count:"))
            .context("fdinfo of an eventfd without eventfd-count")?;
        total += u64::from_str_radix(count.trim(), 16)?;
    }
    Ok(total)
}

/// A new connection does not make a worker thread wake its own event loop through its
/// eventfd (a system call, and one more turn of the loop): its connect timeout is never the
/// runtime's earliest timer, because each worker keeps a tick pending (workers.rs). Without
/// the tick, each of these one-at-a-time connections cost one such write.
#[tokio::test]
async fn new_connections_do_not_wake_the_event_loop_by_eventfd() -> Result<()> {
    let (_backend, listen, proxy) = echo_proxy().await?;
    connect_echo(listen).await?;
    const CONNECTIONS: u64 = 300;
    let before = eventfd_writes(proxy.pid())?;
    for _ in 0..CONNECTIONS {
        let mut client = TcpClient::connect(listen).await?;
        client.round_trip(b"hello").await?;
    }
    let writes = eventfd_writes(proxy.pid())? - before;
    println!("{CONNECTIONS} connections, {writes} eventfd writes");
    // Without the tick: one write per connection. With it: the ticks' own and the main
    // runtime's (health checks), a few per second; a third leaves room for a slow machine.
    ensure!(
        writes < CONNECTIONS / 3,
        "{writes} eventfd writes for {CONNECTIONS} connections made one at a time"
    );
    Ok(())
}
