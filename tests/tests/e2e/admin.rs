//! Admin surface: `/healthz`, `/readyz`, `/metrics` names, `/status` JSON, and the
//! `probe` subcommand's exit codes.

use anyhow::{ensure, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::proxy::{parse_metric, run_cli};
use kube_apiserver_proxy_tests::util::{eventually, free_addr};

use crate::{
    connect_echo, echo_backend, echo_proxy, echo_proxy_with, https_client, https_proxy,
    listen_addr, serving, tcp_proxy, DEADLINE,
};
use crate::{https_backend_unready, proxy_before_its_backend};

#[tokio::test]
async fn healthz_readyz_and_metrics_follow_the_lifecycle() -> Result<()> {
    let pki = Pki::new()?;
    let (backend, listen, proxy) = proxy_before_its_backend(&pki).await?;
    proxy.wait_state("WaitingForBackend").await?;
    let (status, body) = proxy.admin_get("/healthz").await?;
    ensure!(
        status == 200 && body.trim() == "ok",
        "/healthz: {status} {body}"
    );
    let (status, _) = proxy.admin_get("/readyz").await?;
    ensure!(status == 503, "/readyz while WaitingForBackend: {status}");
    let metrics = proxy.metrics().await?;
    let waiting = parse_metric(
        &metrics,
        "lifecycle_state",
        &[("state", "WaitingForBackend")],
    );
    ensure!(
        waiting == Some(1.0),
        "lifecycle_state{{WaitingForBackend}} = {waiting:?}"
    );

    backend.set_ready(true);
    proxy.wait_state("Serving").await?;
    eventually(DEADLINE, || async {
        let (status, _) = proxy.admin_get("/readyz").await?;
        ensure!(status == 200, "/readyz while Serving: {status}");
        Ok(())
    })
    .await?;
    let (status, _) = https_client(&pki)?.get(listen, "/version").await?;
    ensure!(status == 200, "/version through the proxy: {status}");

    let backend_label = backend.addr().to_string();
    let backend_labels = [("backend", backend_label.as_str())];
    let metrics = eventually(DEADLINE, || async {
        let metrics = proxy.metrics().await?;
        let bytes = parse_metric(
            &metrics,
            "bytes_total",
            &[("direction", "backend_to_client")],
        );
        ensure!(
            bytes.unwrap_or(0.0) > 0.0,
            "bytes_total backend_to_client = {bytes:?}"
        );
        Ok(metrics)
    })
    .await?;
    let expect = |name: &str, labels: &[(&str, &str)]| -> Result<f64> {
        parse_metric(&metrics, name, labels).ok_or_else(|| {
            anyhow::anyhow!("metric {name} {labels:?} missing from /metrics:\n{metrics}")
        })
    };
    ensure!(
        expect("connections_accepted_total", &[])? >= 1.0,
        "connections_accepted_total"
    );
    expect("connections_active", &[])?;
    ensure!(
        expect("bytes_total", &[("direction", "client_to_backend")])? > 0.0,
        "bytes_total client_to_backend"
    );
    ensure!(expect("backend_up", &backend_labels)? == 1.0, "backend_up");
    expect("backend_active_connections", &backend_labels)?;
    ensure!(
        expect("backend_connect_duration_seconds_count", &backend_labels)? >= 1.0,
        "backend_connect_duration_seconds_count"
    );
    expect("backend_connect_duration_seconds_bucket", &backend_labels)?;
    ensure!(
        expect(
            "health_checks_total",
            &[("backend", &backend_label), ("result", "ok")]
        )? >= 1.0,
        "health_checks_total ok"
    );
    ensure!(
        expect(
            "health_checks_total",
            &[("backend", &backend_label), ("result", "not_ready")]
        )? >= 1.0,
        "health_checks_total not_ready"
    );
    ensure!(
        expect("lifecycle_state", &[("state", "Serving")])? == 1.0,
        "Serving = 1"
    );
    ensure!(
        expect("lifecycle_state", &[])? == 1.0,
        "exactly one lifecycle_state is 1"
    );
    ensure!(
        expect("build_info", &[("version", env!("CARGO_PKG_VERSION"))])? == 1.0,
        "build_info"
    );

    // The backend turning unready makes /readyz false; the instance keeps serving.
    backend.set_ready(false);
    eventually(DEADLINE, || async {
        let (status, _) = proxy.admin_get("/readyz").await?;
        ensure!(status == 503, "/readyz with the backend unready: {status}");
        Ok(())
    })
    .await?;
    ensure!(
        proxy.state().await? == "Serving",
        "state changed when the backend fell"
    );
    Ok(())
}

/// Two instances on one host (a surge on one node) start with no admin flag at all: the
/// default admin address picks a free port, so neither collides with the other.
#[tokio::test]
async fn two_instances_coexist_with_the_default_admin_address() -> Result<()> {
    let backend = echo_backend().await?;
    let first = serving(
        tcp_proxy(listen_addr()?, &[&backend])
            .fast_health()
            .default_admin_listen(),
    )
    .await?;
    let second = serving(
        tcp_proxy(listen_addr()?, &[&backend])
            .fast_health()
            .default_admin_listen(),
    )
    .await?;
    ensure!(
        first.admin_addr() != second.admin_addr(),
        "one admin address for two instances"
    );
    for proxy in [&first, &second] {
        ensure!(
            proxy.admin_addr().ip().is_loopback(),
            "admin not on loopback"
        );
        let (code, _) = proxy.admin_get("/readyz").await?;
        ensure!(code == 200, "/readyz {code}");
        proxy
            .wait_stderr(&format!("admin.addr={}", proxy.admin_addr()))
            .await?;
    }
    Ok(())
}

#[tokio::test]
async fn status_json_shape() -> Result<()> {
    // Two worker threads: one socket of the address's reuseport group each.
    let (backend, listen, proxy) = echo_proxy_with(|b| b.args(["--worker-threads", "2"])).await?;
    proxy.wait_backend_health(backend.addr(), "up").await?;
    let _client = connect_echo(listen).await?;
    let status = eventually(DEADLINE, || async {
        let status = proxy.status().await?;
        ensure!(
            status["backends"][0]["active_connections"] == 1,
            "active_connections not 1: {status}"
        );
        Ok(status)
    })
    .await?;
    ensure!(status["state"] == "Serving", "{status}");
    let listeners = status["listeners"].as_array().cloned().unwrap_or_default();
    ensure!(listeners.len() == 2, "listeners: {status}");
    for listener in &listeners {
        ensure!(
            listener["address"] == listen.to_string(),
            "listener address: {status}"
        );
        ensure!(
            listener["cookie"].is_u64() && listener["inode"].as_u64().unwrap_or(0) > 0,
            "listener identity (cookie, inode): {status}"
        );
    }
    ensure!(
        listeners[0]["cookie"] != listeners[1]["cookie"],
        "two sockets, not one twice: {status}"
    );
    let backends = status["backends"].as_array().cloned().unwrap_or_default();
    ensure!(backends.len() == 1, "backends: {status}");
    let entry = &backends[0];
    ensure!(
        entry["address"] == backend.addr().to_string(),
        "address: {entry}"
    );
    ensure!(entry["source"] == "static", "source: {entry}");
    ensure!(entry["healthy"] == true, "healthy: {entry}");
    ensure!(entry["health"] == "up", "health: {entry}");
    ensure!(status["peers"].is_array(), "peers: {status}");
    Ok(())
}

#[tokio::test]
async fn connections_active_returns_to_zero() -> Result<()> {
    let (_backend, listen, proxy) = echo_proxy().await?;
    let mut client = connect_echo(listen).await?;
    eventually(DEADLINE, || async {
        let active = proxy.metric_or_zero("connections_active", &[]).await?;
        ensure!(active == 1.0, "connections_active = {active}");
        Ok(())
    })
    .await?;
    client.shutdown_write().await?;
    client.read_to_end(DEADLINE).await?;
    drop(client);
    eventually(DEADLINE, || async {
        let active = proxy.metric_or_zero("connections_active", &[]).await?;
        ensure!(active == 0.0, "connections_active = {active}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn probe_exit_codes() -> Result<()> {
    let pki = Pki::new()?;
    let backend = https_backend_unready(&pki).await?;
    let proxy = https_proxy(&pki, listen_addr()?, &[&backend])
        .fast_health()
        .spawn()
        .await?;
    proxy.wait_state("WaitingForBackend").await?;
    let admin = proxy.admin_addr();
    let probe = |path: String| async move {
        let output = run_cli(["probe", "--timeout", "1s", path.as_str()]).await?;
        anyhow::Ok(output.status.code())
    };
    let healthz = probe(format!("http://{admin}/healthz")).await?;
    ensure!(healthz == Some(0), "probe /healthz: {healthz:?}");
    let readyz = probe(format!("http://{admin}/readyz")).await?;
    ensure!(readyz == Some(1), "probe /readyz while waiting: {readyz:?}");
    let missing = probe(format!("http://{admin}/no-such-path")).await?;
    ensure!(missing == Some(1), "probe of a 404: {missing:?}");
    let nobody = free_addr("127.0.0.1".parse()?)?;
    let refused = probe(format!("http://{nobody}/healthz")).await?;
    ensure!(refused == Some(1), "probe of a closed port: {refused:?}");

    backend.set_ready(true);
    proxy.wait_state("Serving").await?;
    let readyz = eventually(DEADLINE, || async {
        let code = probe(format!("http://{admin}/readyz")).await?;
        ensure!(code == Some(0), "probe /readyz while serving: {code:?}");
        Ok(code)
    })
    .await?;
    ensure!(readyz == Some(0), "probe /readyz: {readyz:?}");
    Ok(())
}

/// `probe` over HTTPS, as the apiserver container's liveness probe uses it: the address comes
/// from the file `launch` writes, the certificate is verified against the cluster CA with the
/// server name `kubernetes`.
#[tokio::test]
async fn probe_https_checks_the_apiserver_itself() -> Result<()> {
    let pki = Pki::new()?;
    let apiserver = FakeApiserver::https(&pki)
        .random_loopback()?
        .start()
        .await?;
    let address_file = pki.dir().join("address");
    std::fs::write(&address_file, format!("{}\n", apiserver.addr()))?;
    let ca = pki.ca_file();
    let run = |args: Vec<String>| async move {
        let output = run_cli(args).await?;
        anyhow::Ok((
            output.status.code(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        ))
    };
    let by_file = |path: &str, ca: &std::path::Path| {
        vec![
            "probe".to_string(),
            format!("--address-file={}", address_file.display()),
            format!("--path={path}"),
            format!("--ca-file={}", ca.display()),
        ]
    };
    let (code, err) = run(by_file("/livez", &ca)).await?;
    ensure!(code == Some(0), "/livez over https: {code:?} {err}");
    let url = format!("https://{}/version", apiserver.addr());
    let (code, err) = run(vec![
        "probe".into(),
        url.clone(),
        format!("--ca-file={}", ca.display()),
    ])
    .await?;
    ensure!(code == Some(0), "URL form: {code:?} {err}");
    apiserver.set_ready(false);
    let (code, _) = run(by_file("/readyz", &ca)).await?;
    ensure!(code == Some(1), "/readyz 503 must fail the probe: {code:?}");
    // A certificate from another CA is not trusted.
    let other = Pki::new()?;
    let (code, err) = run(by_file("/livez", &other.ca_file())).await?;
    ensure!(
        code == Some(1) && err.contains("TLS"),
        "foreign CA: {code:?} {err}"
    );
    // https without any trust setting is bad input.
    let (code, err) = run(vec!["probe".into(), url]).await?;
    ensure!(
        code == Some(2) && err.contains("--ca-file"),
        "no CA: {code:?} {err}"
    );
    Ok(())
}
