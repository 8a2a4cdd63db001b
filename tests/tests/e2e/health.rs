//! Backends and health (DESIGN §5): https/tls/tcp checks with rise/fall, passive failure on
//! real traffic, not-ready versus dead backends, fail-open, least-connections selection.

use std::time::Duration;

use anyhow::{ensure, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::TcpClient;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::proxy::{Proxy, ProxyBuilder};
use kube_apiserver_proxy_tests::util::{connection_refused, eventually, TempDir};
use tokio::io::AsyncReadExt as _;

use crate::{
    connect_echo, echo_backend, echo_proxy, https_backend, https_client, https_proxy, listen_addr,
    serving, tcp_proxy, DEADLINE,
};
use crate::{https_backend_requiring_client_cert, https_backend_unready};

async fn checks(proxy: &Proxy, backend: &FakeApiserver, result: &str) -> Result<f64> {
    proxy
        .metric_or_zero(
            "health_checks_total",
            &[("backend", &backend.addr().to_string()), ("result", result)],
        )
        .await
}

/// Switches the backend's readiness and waits until one check has seen the new answer.
async fn set_ready_and_wait_one_check(
    proxy: &Proxy,
    backend: &FakeApiserver,
    ready: bool,
) -> Result<()> {
    let result = if ready { "ok" } else { "not_ready" };
    let before = checks(proxy, backend, result).await?;
    backend.set_ready(ready);
    eventually(DEADLINE, || async {
        let now = checks(proxy, backend, result).await?;
        ensure!(now > before, "no {result} check yet");
        Ok(())
    })
    .await
}

async fn backend_up(proxy: &Proxy, backend: &FakeApiserver) -> Result<Option<f64>> {
    proxy
        .metric("backend_up", &[("backend", &backend.addr().to_string())])
        .await
}

async fn health(proxy: &Proxy, backend: &FakeApiserver) -> Result<String> {
    Ok(proxy.backend_status(backend.addr()).await?["health"]
        .as_str()
        .unwrap_or("?")
        .to_owned())
}

#[tokio::test]
async fn https_check_respects_rise_and_fall() -> Result<()> {
    let pki = Pki::new()?;
    let backend = https_backend(&pki).await?;
    let listen = listen_addr()?;
    let proxy = serving(https_proxy(&pki, listen, &[&backend]).health_timing(
        Duration::from_millis(200),
        3,
        3,
    ))
    .await?;
    proxy.wait_backend_health(backend.addr(), "up").await?;
    let up = backend_up(&proxy, &backend).await?;
    ensure!(up == Some(1.0), "backend_up = {up:?}");

    // One failed check is not enough to fall (fall = 3).
    set_ready_and_wait_one_check(&proxy, &backend, false).await?;
    ensure!(
        health(&proxy, &backend).await? == "up",
        "backend fell after a single not-ready check"
    );
    proxy.wait_backend_health(backend.addr(), "down").await?;
    let entry = proxy.backend_status(backend.addr()).await?;
    ensure!(entry["healthy"] == false, "down but healthy: {entry}");
    let up = backend_up(&proxy, &backend).await?;
    ensure!(up == Some(0.0), "backend_up = {up:?} while down");

    // One passing check is not enough to rise (rise = 3).
    set_ready_and_wait_one_check(&proxy, &backend, true).await?;
    ensure!(
        health(&proxy, &backend).await? == "down",
        "backend rose after a single passing check"
    );
    proxy.wait_backend_health(backend.addr(), "up").await?;
    Ok(())
}

#[tokio::test]
async fn https_check_uses_health_path() -> Result<()> {
    let pki = Pki::new()?;
    let backend = https_backend_unready(&pki).await?;
    let listen = listen_addr()?;
    // /readyz says 503 but /livez says 200: with --health-path /livez the backend is up.
    let _proxy = serving(
        https_proxy(&pki, listen, &[&backend])
            .fast_health()
            .args(["--health-path", "/livez"]),
    )
    .await?;
    ensure!(backend.requests("/livez") > 0, "no /livez request");
    ensure!(backend.requests("/readyz") == 0, "checked /readyz instead");
    Ok(())
}

#[tokio::test]
async fn https_check_with_client_certificate() -> Result<()> {
    let pki = Pki::new()?;
    let backend = https_backend_requiring_client_cert(&pki).await?;
    // Without a client certificate the check fails …
    let without = https_proxy(&pki, listen_addr()?, &[&backend])
        .fast_health()
        .spawn()
        .await?;
    eventually(DEADLINE, || async {
        without.ensure_running()?;
        let failed = checks(&without, &backend, "failed").await?;
        ensure!(failed >= 2.0, "{failed} failed checks");
        Ok(())
    })
    .await?;
    ensure!(
        without.state().await? == "WaitingForBackend",
        "serving without client cert"
    );
    // … with one it passes.
    serving(
        https_proxy(&pki, listen_addr()?, &[&backend])
            .fast_health()
            .health_client_cert(pki.client_cert_file(), pki.client_key_file()),
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn tls_check_verifies_the_ca_and_ignores_readyz() -> Result<()> {
    let pki = Pki::new()?;
    let other_pki = Pki::new()?;
    // Unready: a tls check only does the handshake, so it passes anyway.
    let backend = https_backend_unready(&pki).await?;
    let listen = listen_addr()?;
    let good = serving(
        ProxyBuilder::new()
            .listen(listen)
            .backend(backend.addr())
            .health_check("tls")
            .ca_file(&pki.ca_file())
            .fast_health(),
    )
    .await?;
    ensure!(
        backend.requests("/readyz") == 0,
        "tls check sent HTTP requests"
    );
    drop(good);

    // A CA that did not sign the serving certificate: the handshake check fails.
    let listen = listen_addr()?;
    let bad = ProxyBuilder::new()
        .listen(listen)
        .backend(backend.addr())
        .health_check("tls")
        .ca_file(&other_pki.ca_file())
        .fast_health()
        .spawn()
        .await?;
    eventually(DEADLINE, || async {
        bad.ensure_running()?;
        let failed = checks(&bad, &backend, "failed").await?;
        ensure!(failed >= 2.0, "{failed} failed checks");
        Ok(())
    })
    .await?;
    ensure!(
        bad.state().await? == "WaitingForBackend",
        "serving with a wrong CA"
    );
    ensure!(
        connection_refused(listen).await,
        "{listen} accepts with a wrong CA"
    );
    Ok(())
}

#[tokio::test]
async fn connect_failure_is_retried_on_the_next_backend() -> Result<()> {
    let broken = echo_backend().await?;
    let good = echo_backend().await?;
    let listen = listen_addr()?;
    // Slow active checks (fall needs ~4s) so that real traffic finds the failure first.
    let proxy =
        serving(tcp_proxy(listen, &[&broken, &good]).health_timing(Duration::from_secs(1), 1, 5))
            .await?;
    proxy.wait_backend_health(broken.addr(), "up").await?;
    proxy.wait_backend_health(good.addr(), "up").await?;
    broken.stop_listening().await;
    // Held at once: least-connections must try `broken` for at least one of them.
    let mut clients = Vec::new();
    for i in 0..4u8 {
        let mut client = TcpClient::connect(listen).await?;
        client.round_trip(&[i; 100]).await?;
        clients.push(client);
    }
    ensure!(
        good.active_sessions() == 4,
        "good backend has {} sessions",
        good.active_sessions()
    );
    let failures = proxy
        .metric_or_zero(
            "backend_connect_failures_total",
            &[("backend", &broken.addr().to_string())],
        )
        .await?;
    ensure!(
        failures >= 1.0,
        "no connect failure counted for the broken backend"
    );
    let no_backend = proxy
        .metric_or_zero("connections_failed_total", &[("reason", "no_backend")])
        .await?;
    ensure!(
        no_backend == 0.0,
        "clients were failed: no_backend = {no_backend}"
    );
    Ok(())
}

#[tokio::test]
async fn not_ready_backend_gets_no_new_connections_but_keeps_existing() -> Result<()> {
    let pki = Pki::new()?;
    let a = https_backend(&pki).await?;
    let b = https_backend(&pki).await?;
    let listen = listen_addr()?;
    let proxy = serving(https_proxy(&pki, listen, &[&a, &b]).fast_health()).await?;
    proxy.wait_backend_health(a.addr(), "up").await?;
    proxy.wait_backend_health(b.addr(), "up").await?;
    let client = https_client(&pki)?;
    let mut watch = client.watch(listen, "/watch?interval_ms=50").await?;
    watch.next_line(DEADLINE).await?;
    let (holder, other) = if a.active_watches() == 1 {
        (&a, &b)
    } else {
        (&b, &a)
    };
    ensure!(holder.active_watches() == 1, "watch not found on a backend");

    holder.set_ready(false);
    proxy.wait_backend_health(holder.addr(), "down").await?;
    let mut connections = Vec::new();
    for _ in 0..4 {
        let mut connection = client.connect(listen).await?;
        let (status, _) = connection.get("/version").await?;
        ensure!(status == 200, "/version: {status}");
        connections.push(connection);
    }
    ensure!(
        holder.requests("/version") == 0,
        "the not-ready backend got {} new requests",
        holder.requests("/version")
    );
    ensure!(
        other.requests("/version") == 4,
        "other got {}",
        other.requests("/version")
    );
    // The existing stream on the not-ready backend goes on, over many health intervals.
    for _ in 0..10 {
        watch.next_line(Duration::from_secs(2)).await?;
    }
    ensure!(
        holder.active_watches() == 1,
        "watch closed on the not-ready backend"
    );
    Ok(())
}

/// A check that fails says why, in `/status` and in the log, and the log line is not repeated
/// for every check: a CA that did not sign the backend's certificate, then a backend whose
/// `/readyz` answers 503.
#[tokio::test]
async fn health_check_failure_causes_are_logged_at_a_bounded_rate_and_shown() -> Result<()> {
    let pki = Pki::new()?;
    let other_ca = Pki::new()?;
    let backend = https_backend(&pki).await?;
    let listen = listen_addr()?;
    let proxy = https_proxy(&other_ca, listen, &[&backend])
        .fast_health()
        .spawn()
        .await?;
    eventually(DEADLINE, || async {
        let entry = proxy.backend_status(backend.addr()).await?;
        let c = entry["last_check"]["cause"].as_str().unwrap_or("");
        ensure!(c.contains("certificate"), "cause {c:?}");
        Ok(())
    })
    .await?;
    // Twenty more failing checks (100 ms apart) with the same cause.
    let failed = checks(&proxy, &backend, "failed").await?;
    eventually(DEADLINE, || async {
        ensure!(
            checks(&proxy, &backend, "failed").await? >= failed + 20.0,
            "checks not running"
        );
        Ok(())
    })
    .await?;
    proxy.wait_stderr("health check failed").await?;
    let stderr = proxy.stderr();
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("health check failed"))
        .collect();
    ensure!(
        !lines.is_empty() && lines[0].contains("certificate"),
        "cause not logged: {stderr}"
    );
    ensure!(
        lines.len() <= 2,
        "{} lines for one cause: {lines:?}",
        lines.len()
    );
    proxy.ensure_running()?;
    drop(proxy);

    let unready = https_backend_unready(&pki).await?;
    let proxy = https_proxy(&pki, listen_addr()?, &[&unready])
        .fast_health()
        .spawn()
        .await?;
    eventually(DEADLINE, || async {
        let entry = proxy.backend_status(unready.addr()).await?;
        let c = entry["last_check"]["cause"]
            .as_str()
            .unwrap_or("")
            .to_string();
        ensure!(c.contains("HTTP 503"), "cause {c:?}");
        ensure!(entry["last_check"]["result"] == "not_ready", "{entry}");
        Ok(())
    })
    .await?;
    proxy.wait_stderr("HTTP 503").await?;

    // A request the apiserver refuses (here a path it does not serve; a 401 or 403 for a check
    // without access is the same) is a failed check, with the status as its cause.
    let proxy = https_proxy(&pki, listen_addr()?, &[&backend])
        .fast_health()
        .args(["--health-path", "/nope"])
        .spawn()
        .await?;
    eventually(DEADLINE, || async {
        let entry = proxy.backend_status(backend.addr()).await?;
        let c = entry["last_check"]["cause"]
            .as_str()
            .unwrap_or("")
            .to_string();
        ensure!(c.contains("HTTP 404"), "cause {c:?}");
        ensure!(entry["last_check"]["result"] == "failed", "{entry}");
        Ok(())
    })
    .await?;
    Ok(())
}

/// A backend that closes its listener and keeps its established connections (what
/// kube-apiserver does at shutdown: the listener closes, in-flight requests and watches go on)
/// is dead for new connections, but the connections it carries are not cut.
#[tokio::test]
async fn a_backend_that_stops_listening_keeps_its_established_connections() -> Result<()> {
    let (backend, listen, proxy) = echo_proxy().await?;
    let mut client = connect_echo(listen).await?;
    backend.stop_listening().await;
    proxy.wait_backend_health(backend.addr(), "dead").await?;
    // Many health intervals later (100 ms each), the connection still carries bytes both ways.
    for i in 0..10 {
        let seen = checks(&proxy, &backend, "refused").await?;
        eventually(DEADLINE, || async {
            ensure!(
                checks(&proxy, &backend, "refused").await? > seen,
                "no further check"
            );
            Ok(())
        })
        .await?;
        client
            .round_trip(format!("still here {i}").as_bytes())
            .await?;
    }
    // The instance keeps its listener (DESIGN §3).
    ensure!(
        !connection_refused(listen).await,
        "listener closed when the backend died"
    );
    Ok(())
}

/// With no backend reachable, a new client is held, not accepted and closed: a backend that
/// appears within `--connect-timeout` (here the own backend moving to a new address, as when
/// the apiserver container restarts) carries it.
#[tokio::test]
async fn a_client_with_no_usable_backend_is_held_until_one_appears() -> Result<()> {
    let dir = TempDir::new("hold")?;
    let own_file = dir.join("own-backend");
    let first = echo_backend().await?;
    std::fs::write(&own_file, format!("{}\n", first.addr()))?;
    let listen = listen_addr()?;
    let proxy = serving(
        ProxyBuilder::new()
            .listen(listen)
            .arg("--own-backend-file")
            .arg(&own_file)
            .health_check("tcp")
            .fast_health()
            .args(["--connect-timeout", "20s"]),
    )
    .await?;
    let mut established = connect_echo(listen).await?;
    first.stop_listening().await;
    proxy.wait_backend_health(first.addr(), "dead").await?;

    let mut held = TcpClient::connect(listen).await?;
    held.write_all(b"held").await?;
    // The proxy tries the dead backend again and again while the client waits.
    let attempts = || async {
        proxy
            .metric_or_zero(
                "backend_connect_failures_total",
                &[("backend", &first.addr().to_string())],
            )
            .await
    };
    let before = attempts().await?;
    eventually(DEADLINE, || async {
        ensure!(attempts().await? >= before + 2.0, "not retried");
        Ok(())
    })
    .await?;
    let second = echo_backend().await?;
    std::fs::write(&own_file, format!("{}\n", second.addr()))?;
    let mut echo = [0u8; 4];
    tokio::time::timeout(DEADLINE, held.stream().read_exact(&mut echo)).await??;
    ensure!(&echo == b"held", "echo {echo:?}");
    held.round_trip(b"and more").await?;
    established.round_trip(b"old connection").await?;
    let no_backend = proxy
        .metric_or_zero("connections_failed_total", &[("reason", "no_backend")])
        .await?;
    ensure!(no_backend == 0.0, "{no_backend} clients turned away");
    Ok(())
}

#[tokio::test]
async fn no_healthy_backend_fails_open() -> Result<()> {
    let pki = Pki::new()?;
    let backend = https_backend(&pki).await?;
    let listen = listen_addr()?;
    let proxy = serving(https_proxy(&pki, listen, &[&backend]).fast_health()).await?;
    backend.set_ready(false);
    proxy.wait_backend_health(backend.addr(), "down").await?;
    // Nothing is healthy: the proxy tries the backend anyway rather than refuse.
    let (status, _) = https_client(&pki)?.get(listen, "/version").await?;
    ensure!(status == 200, "/version with no healthy backend: {status}");
    ensure!(
        backend.requests("/version") == 1,
        "backend did not get the request"
    );
    let (readyz, _) = proxy.admin_get("/readyz").await?;
    ensure!(readyz == 503, "/readyz = {readyz} with no healthy backend");
    Ok(())
}

/// With every backend refusing, the client is held and every backend tried again until
/// `--connect-timeout` has passed; only then is the client closed, with a FIN although its
/// bytes were never read, and counted.
#[tokio::test]
async fn every_backend_is_tried_until_the_connect_timeout_before_the_client_is_closed() -> Result<()>
{
    let a = echo_backend().await?;
    let b = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(
        tcp_proxy(listen, &[&a, &b])
            .fast_health()
            .args(["--connect-timeout", "1s"]),
    )
    .await?;
    a.stop_listening().await;
    b.stop_listening().await;
    proxy.wait_backend_health(a.addr(), "dead").await?;
    proxy.wait_backend_health(b.addr(), "dead").await?;
    let failures = |fake: &FakeApiserver| {
        let labels = fake.addr().to_string();
        let proxy = &proxy;
        async move {
            proxy
                .metric_or_zero("backend_connect_failures_total", &[("backend", &labels)])
                .await
        }
    };
    let (a_before, b_before) = (failures(&a).await?, failures(&b).await?);
    let no_backend_before = proxy
        .metric_or_zero("connections_failed_total", &[("reason", "no_backend")])
        .await?;

    // Its bytes are never read: the close must still be a FIN, not a reset for unread bytes.
    let mut client = TcpClient::connect(listen).await?;
    let _ = client.write_all(b"anyone?").await;
    client.wait_eof(Duration::from_secs(10)).await?;

    eventually(DEADLINE, || async {
        let no_backend = proxy
            .metric_or_zero("connections_failed_total", &[("reason", "no_backend")])
            .await?;
        ensure!(
            no_backend == no_backend_before + 1.0,
            "no_backend = {no_backend}"
        );
        Ok(())
    })
    .await?;
    let (a_after, b_after) = (failures(&a).await?, failures(&b).await?);
    ensure!(
        a_after - a_before >= 2.0 && b_after - b_before >= 2.0,
        "connect attempts per backend: a {}, b {} (want several each)",
        a_after - a_before,
        b_after - b_before
    );
    Ok(())
}

#[tokio::test]
async fn selection_prefers_fewest_active_connections() -> Result<()> {
    let pki = Pki::new()?;
    let a = https_backend(&pki).await?;
    let b = https_backend_unready(&pki).await?;
    let listen = listen_addr()?;
    let proxy = serving(https_proxy(&pki, listen, &[&a, &b]).fast_health()).await?;
    proxy.wait_backend_health(b.addr(), "down").await?;
    let client = https_client(&pki)?;
    let mut watches = Vec::new();
    for _ in 0..4 {
        let mut watch = client.watch(listen, "/watch?interval_ms=200").await?;
        watch.next_line(DEADLINE).await?;
        watches.push(watch);
    }
    ensure!(
        a.active_watches() == 4,
        "a has {} watches",
        a.active_watches()
    );

    // b turns healthy with 0 connections against a's 4: the next 4 all go to b.
    b.set_ready(true);
    proxy.wait_backend_health(b.addr(), "up").await?;
    for _ in 0..4 {
        let mut watch = client.watch(listen, "/watch?interval_ms=200").await?;
        watch.next_line(DEADLINE).await?;
        watches.push(watch);
    }
    ensure!(
        a.active_watches() == 4 && b.active_watches() == 4,
        "watches a {} b {} (want 4 and 4)",
        a.active_watches(),
        b.active_watches()
    );
    let entry = proxy.backend_status(b.addr()).await?;
    ensure!(entry["active_connections"] == 4, "/status for b: {entry}");
    Ok(())
}
