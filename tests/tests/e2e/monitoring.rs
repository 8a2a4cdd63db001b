//! Monitoring: the node's scrape endpoint `--metrics-listen` answers with
//! every instance of the node, whichever instance takes the scrape; the series of a removed
//! backend are deleted; and `/peer-ready` with `probe --wait`, which the pods' preStop hooks
//! use to keep serving until a successor is ready.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::{ensure_scrapes_refused, http_get, HttpsClient};
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::process::bad_input_line;
use kube_apiserver_proxy_tests::proxy::{run_cli, Proxy, METRIC_PREFIX};
use kube_apiserver_proxy_tests::util::{eventually, free_random_loopback_addr, TempDir};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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
    instance_with(name, backend, dir, scrape, &[]).await
}

/// [`instance`] with more flags.
async fn instance_with(
    name: &str,
    backend: &FakeApiserver,
    dir: &Path,
    scrape: SocketAddr,
    extra: &[String],
) -> Result<Proxy> {
    let proxy = tcp_proxy(listen_addr()?, &[backend])
        .fast_health()
        .drain_timeout(Duration::from_millis(500))
        .arg("--handoff-dir")
        .arg(dir)
        .arg(format!("--metrics-listen={scrape}"))
        .arg(format!("--metrics-label=pod={name}"))
        .args(extra)
        .spawn()
        .await?;
    proxy.wait_state("Serving").await?;
    Ok(proxy)
}

/// The address `proxy` published for the other instances' scrapes (`kap-<pid>-<n>.admin` in
/// the handoff directory).
fn published_address(dir: &Path, proxy: &Proxy) -> Result<SocketAddr> {
    let prefix = format!("kap-{}-", proxy.pid());
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.starts_with(&prefix) && name.ends_with(".admin") {
            let text = std::fs::read_to_string(dir.join(&name))?;
            return text
                .trim()
                .parse()
                .with_context(|| format!("{name}: {text:?}"));
        }
    }
    anyhow::bail!(
        "pid {} published no address in {}",
        proxy.pid(),
        dir.display()
    )
}

/// The manifest's probe command (`probe --admin-address-file F --path P`, its own default
/// timeout of 1s): whether it passed, and how long it took.
async fn manifest_probe(admin_file: &Path, path: &str) -> Result<(bool, Duration)> {
    let start = Instant::now();
    let out = run_cli([
        "probe",
        "--admin-address-file",
        admin_file.to_str().context("path")?,
        "--path",
        path,
    ])
    .await?;
    Ok((out.status.success(), start.elapsed()))
}

/// A node's probes and its scrapes do not share a connection budget. The other instances'
/// metrics are fetched from a listener of their own, not from the admin endpoint the probes
/// use: with that listener of every instance held full (more idle connections than it
/// serves at once) and the node's scrape address flooded, the manifest's probe commands of
/// both instances keep passing within their 1s. Before the peer-metrics listener existed, the
/// published address was the admin endpoint's, and the held connections starved the probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_answer_while_scrapes_flood_the_node() -> Result<()> {
    let backend = echo_backend().await?;
    let dir = TempDir::new("scrape-flood")?;
    let handoff = dir.join("handoff");
    let scrape = free_random_loopback_addr()?;
    let a = instance("a", &backend, &handoff, scrape).await?;
    let b = instance("b", &backend, &handoff, scrape).await?;
    eventually(DEADLINE, || every_scrape_covers(scrape, &["a", "b"], 1)).await?;
    let mut held = Vec::new();
    for proxy in [&a, &b] {
        let peer = published_address(&handoff, proxy)?;
        ensure!(
            peer != proxy.admin_addr(),
            "the address published for scrapes is the admin endpoint {peer}"
        );
        for _ in 0..40 {
            held.push(tokio::net::TcpStream::connect(peer).await?);
        }
    }
    let flood: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(async move {
                let mut answered = 0u32;
                for _ in 0..25 {
                    if let Ok((200, _)) = http_get(scrape, "/metrics").await {
                        answered += 1;
                    }
                }
                answered
            })
        })
        .collect();
    for round in 0..5 {
        for proxy in [&a, &b] {
            for path in ["/healthz", "/readyz"] {
                let (passed, took) = manifest_probe(proxy.admin_file(), path).await?;
                ensure!(
                    passed,
                    "round {round}: probe {path} of pid {} failed after {took:?}",
                    proxy.pid()
                );
            }
        }
    }
    let mut answered = 0;
    for task in flood {
        answered += task.await?;
    }
    ensure!(answered > 0, "no scrape of the flood was answered");
    drop(held);
    Ok(())
}

/// A minimal instance of the node, as the scrape side sees one: a listener answering
/// `GET /metrics` with a `build_info` sample of `pod`, counting the connections it gets.
async fn fake_peer(pod: &str) -> Result<(SocketAddr, Arc<AtomicU64>)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let count = Arc::new(AtomicU64::new(0));
    let body = format!(
        "# HELP {METRIC_PREFIX}build_info Build.\n# TYPE {METRIC_PREFIX}build_info gauge\n{METRIC_PREFIX}build_info{{pod=\"{pod}\"}} 1\n"
    );
    let seen = count.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            seen.fetch_add(1, Ordering::SeqCst);
            let body = body.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = stream.write_all(answer.as_bytes()).await;
            });
        }
    });
    Ok((addr, count))
}

/// The fan-out of the node's scrape address is cached: a storm of scrapes, many at once,
/// costs each other instance one fetch per `--metrics-cache`; an instance that appears is
/// fetched at the next scrape all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrape_fan_out_is_cached_and_shared_by_concurrent_scrapes() -> Result<()> {
    let backend = echo_backend().await?;
    let dir = TempDir::new("scrape-cache")?;
    let handoff = dir.join("handoff");
    let scrape = free_random_loopback_addr()?;
    let _a = instance_with(
        "a",
        &backend,
        &handoff,
        scrape,
        &["--metrics-cache=1h".to_owned()],
    )
    .await?;
    let (peer, fetched) = fake_peer("x").await?;
    std::fs::write(handoff.join("kap-1-00000001.admin"), format!("{peer}\n"))?;
    eventually(DEADLINE, || every_scrape_covers(scrape, &["a", "x"], 1)).await?;
    let storm: Vec<_> = (0..10)
        .map(|_| tokio::spawn(async move { every_scrape_covers(scrape, &["a", "x"], 10).await }))
        .collect();
    for task in storm {
        task.await??;
    }
    let fetches = fetched.load(Ordering::SeqCst);
    ensure!(
        fetches == 1,
        "101 scrapes fetched the other instance {fetches} times, want 1"
    );
    // Another instance appears: the next scrape covers it, without waiting out the cache.
    let (peer2, _) = fake_peer("y").await?;
    std::fs::write(handoff.join("kap-2-00000002.admin"), format!("{peer2}\n"))?;
    every_scrape_covers(scrape, &["a", "x", "y"], 1).await?;
    // Entries that are not loopback addresses are not fetched.
    std::fs::write(handoff.join("kap-3-00000003.admin"), "0.0.0.0:1\n")?;
    every_scrape_covers(scrape, &["a", "x", "y"], 1).await?;
    Ok(())
}

/// With a certificate, the node's scrape address speaks TLS and answers only scrapers that
/// present a client certificate of `--metrics-client-ca-file` (Prometheus Operator's
/// PodMonitor `tlsConfig`); plain HTTP and a client without a certificate get nothing.
#[tokio::test]
async fn tls_scrape_address_requires_a_client_certificate() -> Result<()> {
    let backend = echo_backend().await?;
    let pki = Pki::new()?;
    let dir = TempDir::new("scrape-tls")?;
    let handoff = dir.join("handoff");
    let scrape = free_random_loopback_addr()?;
    let tls = pki.metrics_tls_flags();
    let _a = instance_with("a", &backend, &handoff, scrape, &tls).await?;
    let _b = instance_with("b", &backend, &handoff, scrape, &tls).await?;
    let client = HttpsClient::new(pki.client_config(true)?);
    let want = BTreeSet::from(["a".to_owned(), "b".to_owned()]);
    eventually(DEADLINE, || async {
        let (code, body) = client.get(scrape, "/metrics").await?;
        ensure!(code == 200, "HTTP {code}");
        let seen = pods_in(&body);
        ensure!(seen == want, "covered {seen:?}");
        Ok(())
    })
    .await?;
    ensure_scrapes_refused(scrape, &pki, 5).await?;
    // Bad flags: one line, exit 2.
    let out = run_cli([
        "run",
        "--listen=127.0.0.1:1",
        "--backend=127.0.0.1:2",
        "--health-check=tcp",
        "--handoff-dir=/nonexistent",
        &format!("--metrics-listen={scrape}"),
        "--metrics-label=pod=a",
        &tls[0],
        &tls[1],
    ])
    .await?;
    let line = bad_input_line(&out, "without a client CA")?;
    ensure!(line.contains("--metrics-client-ca-file"), "{line}");
    Ok(())
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
    probe_peer_ready_with(admin_file, wait, &[]).await
}

/// [`probe_peer_ready`] with more flags.
async fn probe_peer_ready_with(
    admin_file: &Path,
    wait: &str,
    more: &[&str],
) -> Result<(i32, Duration)> {
    let start = Instant::now();
    let mut args = vec![
        "probe",
        "--admin-address-file",
        admin_file.to_str().context("path")?,
        "--path",
        "/peer-ready",
        "--wait",
        wait,
    ];
    args.extend_from_slice(more);
    let out = run_cli(args).await?;
    Ok((
        out.status.code().context("probe killed by a signal")?,
        start.elapsed(),
    ))
}

/// The preStop hooks' `--pass-when-down`: a proxy that runs without a ready peer is still
/// waited for; a missing address file or an address where nothing listens (the pod's proxy does
/// not run) passes at once, and only with the flag.
#[tokio::test]
async fn pass_when_down_ends_a_prestop_wait_only_when_nothing_listens() -> Result<()> {
    let backend = echo_backend().await?;
    let dir = TempDir::new("pass-when-down")?;
    let proxy = tcp_proxy(listen_addr()?, &[&backend])
        .fast_health()
        .arg("--handoff-dir")
        .arg(dir.join("handoff"))
        .spawn()
        .await?;
    proxy.wait_state("Serving").await?;
    let (code, took) =
        probe_peer_ready_with(proxy.admin_file(), "2s", &["--pass-when-down"]).await?;
    ensure!(
        code == 1 && took >= Duration::from_secs(2),
        "a running proxy without a peer: exit {code} after {took:?}"
    );

    let missing = dir.join("no-such-admin-address");
    let refused = dir.join("refused-admin-address");
    // A random 127.a.b.c and port 9: nothing listens there.
    let nothing =
        std::net::SocketAddr::new(kube_apiserver_proxy_tests::util::random_loopback_ip()?, 9);
    std::fs::write(&refused, nothing.to_string())?;
    for file in [&missing, &refused] {
        let (code, took) = probe_peer_ready_with(file, "30s", &["--pass-when-down"]).await?;
        ensure!(
            code == 0 && took < Duration::from_secs(10),
            "nothing listens ({}): exit {code} after {took:?}",
            file.display()
        );
        let (code, took) = probe_peer_ready(file, "2s").await?;
        ensure!(
            code == 1 && took >= Duration::from_secs(2),
            "without the flag ({}): exit {code} after {took:?}",
            file.display()
        );
    }
    Ok(())
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
