//! Monitoring (issue 13 point 7): the node's scrape endpoint `--metrics-listen` answers with
//! every instance of the node, whichever instance takes the scrape; the series of a removed
//! backend are deleted; and `/peer-ready` with `probe --wait`, which the pods' preStop hooks
//! use to keep serving until a successor is ready.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::client::http_get;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::proxy::{run_cli, Proxy, METRIC_PREFIX};
use kube_apiserver_proxy_tests::util::{eventually, free_random_loopback_addr, TempDir};

use crate::{echo_backend, listen_addr, tcp_proxy, DEADLINE};

/// The `pod` label of every `build_info` sample: which instances a scrape covered.
fn pods_in(metrics: &str) -> BTreeSet<String> {
    metrics
        .lines()
        .filter(|l| l.starts_with(&format!("{METRIC_PREFIX}build_info{{")))
        .filter_map(|l| l.split("pod=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect()
}

/// An instance of the node: tcp checks of `backend`, the shared handoff directory and scrape
/// address, and `pod=<name>` on its series.
async fn instance(
    name: &str,
    backend: &FakeApiserver,
    dir: &Path,
    scrape: SocketAddr,
) -> Result<Proxy> {
    let proxy = tcp_proxy(listen_addr()?, &[backend])
        .fast_health()
        .drain_timeout(Duration::from_millis(500))
        .arg("--handoff-dir")
        .arg(dir)
        .arg(format!("--metrics-listen={scrape}"))
        .arg(format!("--metrics-label=pod={name}"))
        .spawn()
        .await?;
    proxy.wait_state("Serving").await?;
    Ok(proxy)
}

/// Scrapes `addr` `n` times, each on a new connection (so each may land on any instance of
/// the `SO_REUSEPORT` group); every answer must cover exactly `want`.
async fn every_scrape_covers(addr: SocketAddr, want: &[&str], n: usize) -> Result<()> {
    let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
    for i in 0..n {
        let (code, body) = http_get(addr, "/metrics").await?;
        ensure!(code == 200, "scrape {i}: HTTP {code}");
        let seen = pods_in(&body);
        ensure!(seen == want, "scrape {i} covered {seen:?}, want {want:?}");
        // A valid exposition: each family's TYPE line once.
        let mut types = BTreeSet::new();
        for line in body.lines().filter(|l| l.starts_with("# TYPE ")) {
            ensure!(types.insert(line.to_owned()), "scrape {i}: {line} twice");
        }
    }
    Ok(())
}

#[tokio::test]
async fn metrics_listen_answers_for_every_instance_of_the_node() -> Result<()> {
    let backend = echo_backend().await?;
    let dir = TempDir::new("scrape")?;
    let handoff = dir.join("handoff");
    let scrape = free_random_loopback_addr()?;
    let a = instance("a", &backend, &handoff, scrape).await?;
    let b = instance("b", &backend, &handoff, scrape).await?;
    // Both are bound to the shared address once each answers for both.
    eventually(DEADLINE, || every_scrape_covers(scrape, &["a", "b"], 1)).await?;
    every_scrape_covers(scrape, &["a", "b"], 20).await?;
    // Each instance's private admin endpoint carries its own label only.
    ensure!(pods_in(&a.metrics().await?) == BTreeSet::from(["a".to_owned()]));
    // Only /metrics is served on the node address.
    let (code, _) = http_get(scrape, "/status").await?;
    ensure!(code == 404, "/status on --metrics-listen: HTTP {code}");

    // An instance killed without cleaning up: its published address is found dead and
    // removed, and the survivor answers alone.
    a.sigkill()?;
    a.wait_exit(DEADLINE).await?;
    eventually(DEADLINE, || every_scrape_covers(scrape, &["b"], 1)).await?;
    every_scrape_covers(scrape, &["b"], 5).await?;
    let published: Vec<String> = std::fs::read_dir(&handoff)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".admin"))
        .collect();
    ensure!(
        published.len() == 1,
        "published admin addresses after the kill: {published:?}"
    );

    // A clean exit removes the instance's own file.
    b.sigterm()?;
    b.wait_exit(DEADLINE).await?;
    let left = std::fs::read_dir(&handoff)?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".admin"))
        .count();
    ensure!(
        left == 0,
        "{left} admin address files left after a clean exit"
    );
    Ok(())
}

/// The `backend` label values of every series in `metrics`.
fn backends_in(metrics: &str) -> BTreeSet<String> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split("backend=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn series_of_a_removed_backend_are_deleted() -> Result<()> {
    let stays = echo_backend().await?;
    let goes = echo_backend().await?;
    let dir = TempDir::new("gone-backend")?;
    let registry = dir.join("backends");
    std::fs::create_dir(&registry)?;
    // Another instance's registration, as `--backend-dir` holds it.
    let entry = registry.join("4242-0000abcd.backend");
    std::fs::write(&entry, format!("{}\n", goes.addr()))?;
    let proxy = tcp_proxy(listen_addr()?, &[&stays])
        .fast_health()
        .arg("--backend-dir")
        .arg(&registry)
        .spawn()
        .await?;
    let both = BTreeSet::from([stays.addr().to_string(), goes.addr().to_string()]);
    eventually(DEADLINE, || async {
        let seen = backends_in(&proxy.metrics().await?);
        ensure!(
            seen == both,
            "backend series {seen:?}, waiting for {both:?}"
        );
        Ok(())
    })
    .await?;
    // The registration goes away (its instance stopped): the backend is removed, and with it
    // every series naming it.
    std::fs::remove_file(&entry)?;
    let left = BTreeSet::from([stays.addr().to_string()]);
    eventually(DEADLINE, || async {
        let seen = backends_in(&proxy.metrics().await?);
        ensure!(
            seen == left,
            "backend series {seen:?}, waiting for {left:?}"
        );
        Ok(())
    })
    .await?;
    Ok(())
}

/// `probe --admin-address-file F --path /peer-ready` with `--wait`: exit code and duration.
async fn probe_peer_ready(admin_file: &Path, wait: &str) -> Result<(i32, Duration)> {
    let start = Instant::now();
    let out = run_cli([
        "probe",
        "--admin-address-file",
        admin_file.to_str().context("path")?,
        "--path",
        "/peer-ready",
        "--wait",
        wait,
    ])
    .await?;
    Ok((
        out.status.code().context("probe killed by a signal")?,
        start.elapsed(),
    ))
}

#[tokio::test]
async fn peer_ready_waits_for_a_ready_successor() -> Result<()> {
    let backend = echo_backend().await?;
    let dir = TempDir::new("peer-ready")?;
    let handoff = dir.join("handoff");
    let listen = listen_addr()?;
    let old = tcp_proxy(listen, &[&backend])
        .fast_health()
        .arg("--handoff-dir")
        .arg(&handoff)
        .spawn()
        .await?;
    old.wait_state("Serving").await?;
    // Alone on the node: no peer, so the hook would wait.
    let (code, _) = old.admin_get("/peer-ready").await?;
    ensure!(code == 503, "/peer-ready without a peer: HTTP {code}");
    let (code, took) = probe_peer_ready(old.admin_file(), "2s").await?;
    ensure!(
        code == 1 && took >= Duration::from_secs(2),
        "probe --wait 2s without a peer: exit {code} after {took:?}"
    );

    // The hook starts waiting; a successor comes up and gets ready: the hook returns.
    let admin_file = old.admin_file().to_owned();
    let hook = tokio::spawn(async move { probe_peer_ready(&admin_file, "60s").await });
    let new = tcp_proxy(listen, &[&backend])
        .fast_health()
        .arg("--handoff-dir")
        .arg(&handoff)
        .spawn()
        .await?;
    new.wait_state("Serving").await?;
    let (code, took) = tokio::time::timeout(DEADLINE * 2, hook).await???;
    ensure!(
        code == 0 && took < Duration::from_secs(30),
        "probe --wait 60s with a ready peer: exit {code} after {took:?}"
    );
    let (code, _) = old.admin_get("/peer-ready").await?;
    ensure!(code == 200, "/peer-ready with a ready peer: HTTP {code}");
    Ok(())
}
