//! The pod (DESIGN §5–§7, docs/architecture.md): the own backend written by
//! `launch`, node-local discovery through `--backend-dir`, readiness per pod with `probe
//! --admin-address-file`, and the two-pod rollout on one node, end to end.
//!
//! A pod here is what the manifests run: `kube-apiserver-proxy launch --address-file A --
//! fake-apiserver --bind-address={{address}} …` (the apiserver container, a real process on a
//! random 127.a.b.c) and a real `kube-apiserver-proxy run` sidecar with `--own-backend-file A`.
//! The pods of one node share `--backend-dir` and `--handoff-dir` and the node address. Tests
//! that need backend counters use in-process fakes and write the address file themselves.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::HttpsClient;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::load::HttpsLoad;
use kube_apiserver_proxy_tests::proxy::{run_cli, Proxy, ProxyBuilder};
use kube_apiserver_proxy_tests::util::{
    connection_refused, eventually, free_random_loopback_addr, TempDir,
};

use crate::https_backend_unready;
use crate::launch::{ensure_launch_ip, free_port, Launched};
use crate::{https_backend, https_client, listen_addr, DEADLINE};

/// `--backend-expiry` of every sidecar here (short: the expiry tests wait for it).
const EXPIRY: Duration = Duration::from_secs(2);

/// A sidecar's flags common to every test: https checks against `pki`'s CA, short timings.
fn sidecar(pki: &Pki, listen: SocketAddr) -> ProxyBuilder {
    ProxyBuilder::new()
        .listen(listen)
        .health_check("https")
        .ca_file(&pki.ca_file())
        .fast_health()
        .arg("--backend-expiry")
        .arg(format!("{}ms", EXPIRY.as_millis()))
}

/// The `--admin-address-file` the harness gave the sidecar (read from its argv: the harness
/// keeps the path to itself).
fn admin_address_file(proxy: &Proxy) -> Result<PathBuf> {
    let raw = std::fs::read(format!("/proc/{}/cmdline", proxy.pid()))?;
    let argv: Vec<&[u8]> = raw.split(|&b| b == 0).collect();
    let i = argv
        .iter()
        .position(|a| *a == b"--admin-address-file")
        .context("sidecar has no --admin-address-file")?;
    let path = argv
        .get(i + 1)
        .context("--admin-address-file without value")?;
    Ok(PathBuf::from(String::from_utf8_lossy(path).into_owned()))
}

/// `kube-apiserver-proxy probe --admin-address-file FILE` (the pods' exec probe): its exit code.
async fn probe(admin_file: &Path) -> Result<i32> {
    let output = run_cli([
        "probe".as_ref(),
        "--timeout".as_ref(),
        "1s".as_ref(),
        "--admin-address-file".as_ref(),
        admin_file.as_os_str(),
    ])
    .await?;
    output.status.code().context("probe killed by a signal")
}

/// Waits until the probe of `admin_file` exits with `want`.
async fn wait_probe(admin_file: &Path, want: i32, deadline: Duration) -> Result<()> {
    eventually(deadline, || async {
        let code = probe(admin_file).await?;
        ensure!(code == want, "probe exits {code}, waiting for {want}");
        Ok(())
    })
    .await
}

/// `/readyz` status code.
async fn readyz(proxy: &Proxy) -> Result<u16> {
    Ok(proxy.admin_get("/readyz").await?.0)
}

/// One backend of `/status`.
#[derive(Debug, Clone, PartialEq)]
struct Backend {
    source: String,
    healthy: bool,
    active: u64,
}

/// The backends of `/status`, by address.
async fn backends(proxy: &Proxy) -> Result<BTreeMap<SocketAddr, Backend>> {
    let status = proxy.status().await?;
    status["backends"]
        .as_array()
        .with_context(|| format!("no backends in {status}"))?
        .iter()
        .map(|b| {
            let addr = b["address"]
                .as_str()
                .context("address")?
                .parse::<SocketAddr>()?;
            let backend = Backend {
                source: b["source"].as_str().context("source")?.to_owned(),
                healthy: b["healthy"].as_bool().context("healthy")?,
                active: b["active_connections"].as_u64().context("active")?,
            };
            Ok((addr, backend))
        })
        .collect()
}

/// Waits until the `/status` backends are exactly `want` (address → (source, healthy)).
async fn wait_backends(proxy: &Proxy, want: &[(SocketAddr, &str, bool)]) -> Result<()> {
    let want: BTreeMap<SocketAddr, (String, bool)> = want
        .iter()
        .map(|(a, s, h)| (*a, (s.to_string(), *h)))
        .collect();
    eventually(DEADLINE, || async {
        proxy.ensure_running()?;
        let seen: BTreeMap<SocketAddr, (String, bool)> = backends(proxy)
            .await?
            .into_iter()
            .map(|(a, b)| (a, (b.source, b.healthy)))
            .collect();
        ensure!(seen == want, "backends {seen:?}, waiting for {want:?}");
        Ok(())
    })
    .await
}

/// The registrations in a `--backend-dir`: entry name → address it holds.
fn registrations(dir: &Path) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".backend") {
            if let Ok(text) = std::fs::read_to_string(dir.join(&name)) {
                out.insert(name, text.trim().to_owned());
            }
        }
    }
    Ok(out)
}

/// Sends `n` `GET /version` through `addr`, each on a new connection; all must succeed.
async fn requests(client: &HttpsClient, addr: SocketAddr, n: usize) -> Result<()> {
    for i in 0..n {
        let (code, body) = client
            .get(addr, "/version")
            .await
            .with_context(|| format!("request {i} through {addr}"))?;
        ensure!(
            code == 200 && body.contains("gitVersion"),
            "request {i}: {code} {body}"
        );
    }
    Ok(())
}

/// `/version` requests each fake received since `before`.
fn version_deltas(fakes: &[&FakeApiserver], before: &[u64]) -> Vec<u64> {
    fakes
        .iter()
        .zip(before)
        .map(|(f, b)| f.requests("/version") - b)
        .collect()
}

fn version_counts(fakes: &[&FakeApiserver]) -> Vec<u64> {
    fakes.iter().map(|f| f.requests("/version")).collect()
}

/// Reads `file` as `ip:port`.
fn read_address(file: &Path) -> Result<SocketAddr> {
    let text = std::fs::read_to_string(file).with_context(|| format!("read {}", file.display()))?;
    text.trim()
        .parse()
        .with_context(|| format!("{}: {text:?}", file.display()))
}

#[tokio::test]
async fn own_backend_file_is_waited_for_then_followed() -> Result<()> {
    let pki = Pki::new()?;
    let dir = TempDir::new("pod-own")?;
    let own_file = dir.join("address");
    let listen = listen_addr()?;
    let proxy = sidecar(&pki, listen)
        .arg("--own-backend-file")
        .arg(&own_file)
        .spawn()
        .await?;

    // No address file yet: nothing to check, nothing bound, not ready.
    proxy.wait_state("WaitingForBackend").await?;
    ensure!(readyz(&proxy).await? == 503, "ready without a backend");
    ensure!(
        backends(&proxy).await?.is_empty(),
        "backends before the file exists"
    );
    ensure!(
        connection_refused(listen).await,
        "{listen} bound before any backend"
    );

    // The apiserver container starts: `launch` writes the file, the proxy uses it.
    let port = free_port()?;
    let first = Launched::fake_apiserver(&pki, &own_file, port, &["--mode=https"])?;
    let first_addr = first.wait_listening().await?;
    ensure!(read_address(&own_file)? == first_addr, "file vs bound");
    proxy.wait_state("Serving").await?;
    wait_backends(&proxy, &[(first_addr, "own", true)]).await?;
    eventually(DEADLINE, || async {
        ensure!(readyz(&proxy).await? == 200, "not ready");
        Ok(())
    })
    .await?;
    let client = https_client(&pki)?;
    requests(&client, listen, 3).await?;
    let mut held = client.connect(listen).await?;
    held.get("/version").await?;
    eventually(DEADLINE, || async {
        let b = backends(&proxy).await?;
        ensure!(
            b.get(&first_addr).map(|b| b.active) == Some(1),
            "{b:?}: waiting for the held connection on {first_addr}"
        );
        Ok(())
    })
    .await?;
    drop(held);

    // The apiserver container restarts: the old process exits, a new `launch` picks a new
    // address and rewrites the same file.
    first.sigterm()?;
    ensure!(first.wait_exit(DEADLINE).await?.success(), "first exit");
    eventually(DEADLINE, || async {
        ensure!(
            readyz(&proxy).await? == 503,
            "still ready with the own apiserver gone"
        );
        Ok(())
    })
    .await?;
    let second = Launched::fake_apiserver(&pki, &own_file, port, &["--mode=https"])?;
    let second_addr = second.wait_listening().await?;
    ensure!(second_addr != first_addr, "launch reused {first_addr}");
    ensure!(
        read_address(&own_file)? == second_addr,
        "file not rewritten"
    );

    // Followed: the old own backend is gone from /status, the new one is own and healthy.
    wait_backends(&proxy, &[(second_addr, "own", true)]).await?;
    eventually(DEADLINE, || async {
        ensure!(readyz(&proxy).await? == 200, "not ready on the new address");
        Ok(())
    })
    .await?;
    // Traffic goes to the new address.
    requests(&client, listen, 3).await?;
    let mut held = client.connect(listen).await?;
    held.get("/version").await?;
    eventually(DEADLINE, || async {
        let b = backends(&proxy).await?;
        ensure!(
            b.get(&second_addr).map(|b| b.active) == Some(1),
            "{b:?}: waiting for the held connection on {second_addr}"
        );
        Ok(())
    })
    .await?;
    ensure!(proxy.state().await? == "Serving", "left Serving");
    Ok(())
}

/// A `--backend-dir` entry naming an address that is not loopback was not written by an
/// instance (each registers its apiserver's random 127.a.b.c): it is refused, never checked
/// or connected to, while a loopback entry beside it is taken. The refused entry here is
/// `0.0.0.0:PORT`, which the kernel would connect to this host's 127.0.0.1:PORT, where a fake
/// apiserver listens: without the rule it would show up as a healthy backend.
#[tokio::test]
async fn backend_dir_refuses_entries_that_are_not_loopback() -> Result<()> {
    let pki = Pki::new()?;
    let dir = TempDir::new("pod-discovery-loopback")?;
    let registry = dir.join("backends");
    std::fs::create_dir(&registry)?;
    let local = https_backend(&pki).await?;
    let lure = FakeApiserver::https(&pki)
        .bind("127.0.0.1:0".parse()?)
        .start()
        .await?;
    let lure_port = lure.addr().port();
    std::fs::write(
        registry.join("4242-00000001.backend"),
        format!("{}\n", local.addr()),
    )?;
    std::fs::write(
        registry.join("4242-00000002.backend"),
        format!("0.0.0.0:{lure_port}\n"),
    )?;
    let fixed = https_backend(&pki).await?;
    let proxy = sidecar(&pki, listen_addr()?)
        .arg("--backend-dir")
        .arg(&registry)
        .backend(fixed.addr())
        .spawn()
        .await?;
    wait_backends(
        &proxy,
        &[
            (local.addr(), "local", true),
            (fixed.addr(), "static", true),
        ],
    )
    .await?;
    // The entry was read and refused (said once, in the log), and it is not a backend.
    proxy.wait_stderr("backend registration refused").await?;
    let seen: Vec<SocketAddr> = backends(&proxy).await?.into_keys().collect();
    ensure!(
        seen.iter().all(|a| a.port() != lure_port),
        "a non-loopback registration became a backend: {seen:?}"
    );
    ensure!(
        lure.accepted() == 0,
        "the proxy connected to a non-loopback registration"
    );
    Ok(())
}

/// Two instances with own backends: each registers its own in `--backend-dir` and uses the
/// other's as `local`; selection prefers own, then local, then static; readiness stays with
/// the own backend.
#[tokio::test]
async fn backend_dir_shares_backends_and_selection_prefers_own_then_local_then_static() -> Result<()>
{
    let pki = Pki::new()?;
    let dir = TempDir::new("pod-discovery")?;
    let registry = dir.join("backends");
    std::fs::create_dir(&registry)?;
    let own1 = https_backend(&pki).await?;
    let own2 = https_backend(&pki).await?;
    let fixed = https_backend(&pki).await?;
    std::fs::write(dir.join("address-1"), format!("{}\n", own1.addr()))?;
    std::fs::write(dir.join("address-2"), format!("{}\n", own2.addr()))?;
    let listen1 = listen_addr()?;
    let listen2 = listen_addr()?;
    let p1 = sidecar(&pki, listen1)
        .arg("--own-backend-file")
        .arg(dir.join("address-1"))
        .arg("--backend-dir")
        .arg(&registry)
        .backend(fixed.addr())
        .spawn()
        .await?;
    let p2 = sidecar(&pki, listen2)
        .arg("--own-backend-file")
        .arg(dir.join("address-2"))
        .arg("--backend-dir")
        .arg(&registry)
        .spawn()
        .await?;

    wait_backends(
        &p1,
        &[
            (own1.addr(), "own", true),
            (own2.addr(), "local", true),
            (fixed.addr(), "static", true),
        ],
    )
    .await?;
    wait_backends(
        &p2,
        &[(own2.addr(), "own", true), (own1.addr(), "local", true)],
    )
    .await?;
    let entries: Vec<String> = registrations(&registry)?.into_values().collect();
    let mut want = vec![own1.addr().to_string(), own2.addr().to_string()];
    want.sort();
    let mut seen = entries.clone();
    seen.sort();
    ensure!(seen == want, "registrations {entries:?}, want {want:?}");
    p1.wait_state("Serving").await?;
    p2.wait_state("Serving").await?;

    let client = https_client(&pki)?;
    let fakes = [&own1, &own2, &fixed];
    const N: usize = 10;

    // Everything healthy: own.
    let before = version_counts(&fakes);
    requests(&client, listen1, N).await?;
    let d = version_deltas(&fakes, &before);
    ensure!(
        d == [N as u64, 0, 0],
        "all healthy: /version per backend {d:?}"
    );
    ensure!(readyz(&p1).await? == 200, "p1 not ready");

    // Own not ready: the other instance's (local) before the static one; p1 is no longer
    // ready although a local and a static backend are healthy (readiness stays per pod).
    own1.set_ready(false);
    wait_backends(
        &p1,
        &[
            (own1.addr(), "own", false),
            (own2.addr(), "local", true),
            (fixed.addr(), "static", true),
        ],
    )
    .await?;
    let before = version_counts(&fakes);
    requests(&client, listen1, N).await?;
    let d = version_deltas(&fakes, &before);
    ensure!(
        d == [0, N as u64, 0],
        "own down: /version per backend {d:?}"
    );
    ensure!(
        readyz(&p1).await? == 503,
        "p1 ready with its own apiserver down"
    );
    ensure!(
        probe(&admin_address_file(&p1)?).await? == 1,
        "probe of p1 passes"
    );
    ensure!(
        probe(&admin_address_file(&p2)?).await? == 0,
        "probe of p2 fails"
    );

    // Own and local not ready: static.
    own2.set_ready(false);
    wait_backends(
        &p1,
        &[
            (own1.addr(), "own", false),
            (own2.addr(), "local", false),
            (fixed.addr(), "static", true),
        ],
    )
    .await?;
    let before = version_counts(&fakes);
    requests(&client, listen1, N).await?;
    let d = version_deltas(&fakes, &before);
    ensure!(
        d == [0, 0, N as u64],
        "own and local down: /version per backend {d:?}"
    );

    // Own back: own again, and ready.
    own1.set_ready(true);
    wait_backends(
        &p1,
        &[
            (own1.addr(), "own", true),
            (own2.addr(), "local", false),
            (fixed.addr(), "static", true),
        ],
    )
    .await?;
    let before = version_counts(&fakes);
    requests(&client, listen1, N).await?;
    let d = version_deltas(&fakes, &before);
    ensure!(
        d == [N as u64, 0, 0],
        "own back: /version per backend {d:?}"
    );
    eventually(DEADLINE, || async {
        ensure!(readyz(&p1).await? == 200, "p1 not ready again");
        Ok(())
    })
    .await?;
    Ok(())
}

/// The registration of an instance that was killed (it could not clean up) is ignored and
/// removed after `--backend-expiry`; one that exits cleanly removes its own at once; an
/// instance whose own backend has been dead stops advertising it.
#[tokio::test]
async fn registrations_of_gone_instances_and_dead_backends_expire() -> Result<()> {
    let pki = Pki::new()?;
    let dir = TempDir::new("pod-expiry")?;
    let registry = dir.join("backends");
    std::fs::create_dir(&registry)?;
    let fakes = [
        https_backend(&pki).await?,
        https_backend(&pki).await?,
        https_backend(&pki).await?,
        https_backend(&pki).await?,
    ];
    let mut proxies = Vec::new();
    for (i, fake) in fakes.iter().enumerate() {
        let file = dir.join(&format!("address-{i}"));
        std::fs::write(&file, format!("{}\n", fake.addr()))?;
        proxies.push(
            sidecar(&pki, listen_addr()?)
                .arg("--own-backend-file")
                .arg(&file)
                .arg("--backend-dir")
                .arg(&registry)
                .spawn()
                .await?,
        );
    }
    let [a, b, c, d] = &fakes;
    let [p1, killed, stopped, orphaned] = &proxies[..] else {
        unreachable!()
    };
    wait_backends(
        p1,
        &[
            (a.addr(), "own", true),
            (b.addr(), "local", true),
            (c.addr(), "local", true),
            (d.addr(), "local", true),
        ],
    )
    .await?;
    let entry_of = |addr: SocketAddr| -> Result<String> {
        registrations(&registry)?
            .into_iter()
            .find(|(_, a)| *a == addr.to_string())
            .map(|(name, _)| name)
            .with_context(|| format!("no registration for {addr}"))
    };
    let killed_entry = entry_of(b.addr())?;
    let stopped_entry = entry_of(c.addr())?;
    let orphaned_entry = entry_of(d.addr())?;

    // Clean exit: the entry goes with the instance.
    stopped.sigterm()?;
    ensure!(stopped.wait_exit(DEADLINE).await?.success(), "SIGTERM exit");
    ensure!(
        !registry.join(&stopped_entry).exists(),
        "a cleanly stopped instance left {stopped_entry}"
    );

    // SIGKILL: the entry stays behind (nobody removed it) until it is older than the expiry.
    killed.sigkill()?;
    killed.wait_exit(DEADLINE).await?;
    let killed_at = Instant::now();
    ensure!(
        registry.join(&killed_entry).exists(),
        "{killed_entry} vanished at once"
    );
    // The orphaned instance lives on, but its own apiserver dies.
    d.vanish().await;
    let dead_at = Instant::now();

    let removed = |entry: String, addr: SocketAddr, since: Instant| {
        let registry = registry.clone();
        async move {
            eventually(EXPIRY * 4 + DEADLINE, || async {
                let b = backends(p1).await?;
                ensure!(
                    !b.contains_key(&addr),
                    "{addr} still a backend of p1: {b:?}"
                );
                ensure!(!registry.join(&entry).exists(), "{entry} still registered");
                Ok(())
            })
            .await?;
            Ok::<_, anyhow::Error>(since.elapsed())
        }
    };
    let (after_kill, after_death) = tokio::try_join!(
        removed(killed_entry, b.addr(), killed_at),
        removed(orphaned_entry, d.addr(), dead_at)
    )?;
    println!(
        "expiry {EXPIRY:?}: killed instance's entry removed after {after_kill:?}, \
         dead backend's after {after_death:?}"
    );
    orphaned.ensure_running()?;
    ensure!(
        readyz(orphaned).await? == 503,
        "ready with its own apiserver dead"
    );
    // Left: p1's own entry only (the orphaned instance no longer advertises its dead one).
    let left: Vec<String> = registrations(&registry)?.into_values().collect();
    ensure!(
        left == [a.addr().to_string()],
        "registrations left: {left:?}"
    );
    wait_backends(p1, &[(a.addr(), "own", true)]).await?;
    Ok(())
}

/// `/readyz` (and the exec probe reading `--admin-address-file`) is true only when the
/// instance is Serving AND its own backend is healthy, whatever else is healthy; two pods'
/// admin endpoints on one host do not collide and each probe reads its own pod's.
#[tokio::test]
async fn readiness_is_per_pod_and_probe_reads_the_admin_address_file() -> Result<()> {
    let pki = Pki::new()?;
    let dir = TempDir::new("pod-ready")?;
    let fixed = https_backend(&pki).await?;
    let own = https_backend(&pki).await?;
    own.set_ready(false);
    let other_own = https_backend_unready(&pki).await?;
    let own_file = dir.join("address");
    let listen = listen_addr()?;
    let pod = sidecar(&pki, listen)
        .arg("--own-backend-file")
        .arg(&own_file)
        .backend(fixed.addr())
        .spawn()
        .await?;
    let pod_admin = admin_address_file(&pod)?;

    // Serving through the static backend, but no own backend yet: not ready.
    pod.wait_state("Serving").await?;
    requests(&https_client(&pki)?, listen, 2).await?;
    ensure!(readyz(&pod).await? == 503, "ready without its own backend");
    ensure!(probe(&pod_admin).await? == 1, "probe passes without own");

    // Own backend known but not ready: still not ready.
    std::fs::write(&own_file, format!("{}\n", own.addr()))?;
    wait_backends(
        &pod,
        &[(own.addr(), "own", false), (fixed.addr(), "static", true)],
    )
    .await?;
    ensure!(readyz(&pod).await? == 503, "ready with own not ready");
    ensure!(probe(&pod_admin).await? == 1, "probe passes with own down");

    // A second pod on the same node address: its own admin endpoint and address file.
    let other_file = dir.join("other-address");
    std::fs::write(&other_file, format!("{}\n", other_own.addr()))?;
    let other = sidecar(&pki, listen)
        .arg("--own-backend-file")
        .arg(&other_file)
        .backend(fixed.addr())
        .spawn()
        .await?;
    let other_admin = admin_address_file(&other)?;
    ensure!(other_admin != pod_admin, "one admin file for both pods");
    ensure!(
        pod.admin_addr() != other.admin_addr(),
        "admin endpoints collide: {}",
        pod.admin_addr()
    );
    ensure!(
        read_address(&pod_admin)? == pod.admin_addr()
            && read_address(&other_admin)? == other.admin_addr(),
        "admin address files do not name the admin endpoints"
    );
    other.wait_state("Serving").await?;

    // Own ready: ready, for this pod only.
    own.set_ready(true);
    wait_probe(&pod_admin, 0, DEADLINE).await?;
    ensure!(readyz(&pod).await? == 200, "/readyz disagrees with probe");
    ensure!(
        probe(&other_admin).await? == 1,
        "the other pod's probe passes"
    );
    other_own.set_ready(true);
    wait_probe(&other_admin, 0, DEADLINE).await?;

    // Own dead (refusing): not ready, though the static backend still serves.
    own.vanish().await;
    wait_probe(&pod_admin, 1, DEADLINE).await?;
    ensure!(pod.state().await? == "Serving", "left Serving");
    requests(&https_client(&pki)?, listen, 2).await?;

    // A probe without a readable admin address file fails (exit 1), in one line.
    let output = run_cli([
        "probe".as_ref(),
        "--admin-address-file".as_ref(),
        dir.join("missing").as_os_str(),
    ])
    .await?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        output.status.code() == Some(1) && stderr.trim().lines().count() == 1,
        "probe with a missing file: {:?} {stderr:?}",
        output.status
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Two pods on one node.

/// One node: the PKI, the node address and the hostPath directories the pods share.
struct Node {
    pki: Pki,
    addr: SocketAddr,
    apiserver_port: u16,
    dir: TempDir,
}

impl Node {
    fn new() -> Result<Self> {
        let dir = TempDir::new("node")?;
        // hostPath volumes (DirectoryOrCreate): they exist before the pods start.
        std::fs::create_dir(dir.join("backends"))?;
        Ok(Self {
            pki: Pki::new()?,
            addr: free_random_loopback_addr()?,
            apiserver_port: free_port()?,
            dir,
        })
    }

    fn backend_dir(&self) -> PathBuf {
        self.dir.join("backends")
    }

    fn handoff_dir(&self) -> PathBuf {
        self.dir.join("handoff")
    }
}

/// One kube-apiserver pod: the apiserver container (`launch` + fake apiserver) and the proxy
/// sidecar, sharing an emptyDir for the address file.
struct Pod {
    name: String,
    apiserver: Launched,
    sidecar: Proxy,
    admin_file: PathBuf,
    _empty_dir: TempDir,
}

impl Pod {
    /// Starts both containers, like the kubelet does (no ordering between them).
    async fn start(node: &Node, name: &str, apiserver_flags: &[&str]) -> Result<Self> {
        let empty_dir = TempDir::new(name)?;
        let address_file = empty_dir.join("address");
        let mut flags = vec!["--mode=https", "--shutdown-delay-duration=1s"];
        flags.extend_from_slice(apiserver_flags);
        let apiserver =
            Launched::fake_apiserver(&node.pki, &address_file, node.apiserver_port, &flags)?;
        let sidecar = sidecar(&node.pki, node.addr)
            .arg("--own-backend-file")
            .arg(&address_file)
            .arg("--backend-dir")
            .arg(node.backend_dir())
            .arg("--handoff-dir")
            .arg(node.handoff_dir())
            .drain_timeout(Duration::from_secs(10))
            .spawn()
            .await?;
        let admin_file = admin_address_file(&sidecar)?;
        Ok(Self {
            name: name.to_owned(),
            apiserver,
            sidecar,
            admin_file,
            _empty_dir: empty_dir,
        })
    }

    /// The apiserver's address (once `launch` wrote it and the apiserver is bound).
    async fn apiserver_addr(&self) -> Result<SocketAddr> {
        let addr = self.apiserver.wait_listening().await?;
        ensure_launch_ip(addr.ip())?;
        Ok(addr)
    }

    /// Waits for the pod's readiness probe to pass.
    async fn wait_ready(&self) -> Result<()> {
        eventually(Duration::from_secs(20), || async {
            self.apiserver.ensure_running()?;
            self.sidecar.ensure_running()?;
            let code = probe(&self.admin_file).await?;
            ensure!(code == 0, "{}: readiness probe exits {code}", self.name);
            Ok(())
        })
        .await
    }

    /// The kubelet deletes the pod: SIGTERM to both containers at the same moment; waits for
    /// both to exit and requires exit 0 of each.
    async fn terminate(&self) -> Result<Duration> {
        let start = Instant::now();
        self.apiserver.sigterm()?;
        self.sidecar.sigterm()?;
        let (apiserver, sidecar) = tokio::join!(
            self.apiserver.wait_exit(Duration::from_secs(20)),
            self.sidecar.wait_exit(Duration::from_secs(20))
        );
        let (apiserver, sidecar) = (apiserver?, sidecar?);
        ensure!(
            apiserver.code() == Some(0),
            "{}: apiserver exit {apiserver}",
            self.name
        );
        ensure!(
            sidecar.code() == Some(0),
            "{}: sidecar exit {sidecar}; stderr:\n{}",
            self.name,
            self.sidecar.stderr()
        );
        Ok(start.elapsed())
    }
}

/// Concurrent clients of the rollout load.
const CLIENTS: usize = 16;
/// Upgrades in a row in the rollout test.
const ROLLOUTS: usize = 3;

fn listener_cookies(status: &serde_json::Value) -> Vec<u64> {
    let mut cookies: Vec<u64> = status["listeners"]
        .as_array()
        .map(|all| all.iter().filter_map(|l| l["cookie"].as_u64()).collect())
        .unwrap_or_default();
    cookies.sort();
    cookies
}

fn report(what: &str, ok: u64, failures: &[String]) -> Result<()> {
    println!("{what}: {ok} requests ok, {} failed", failures.len());
    ensure!(ok > 0, "{what}: no request completed");
    if !failures.is_empty() {
        bail!(
            "{what}: {} of {} requests failed; first: {:?}",
            failures.len(),
            ok + failures.len() as u64,
            &failures[..failures.len().min(5)]
        );
    }
    Ok(())
}

/// The surge rollout on one node. The next pod starts next to the current one and
/// becomes ready (its exec probe), then both of the old pod's containers get SIGTERM at the
/// same moment and exit. Repeated ([`ROLLOUTS`] upgrades in a row) under continuous load with a
/// new TLS connection per request: zero failed requests, and the node address is served by
/// one listening socket from start to end (handed from pod to pod, never re-bound).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_pod_rollout_loses_no_connection() -> Result<()> {
    let started = Instant::now();
    println!(
        "net.ipv4.tcp_migrate_req = {}",
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req")
            .unwrap_or_else(|_| "?".into())
            .trim()
    );
    let node = Node::new()?;
    let mut old = Pod::start(&node, "pod-0", &[]).await?;
    let mut old_api = old.apiserver_addr().await?;
    old.wait_ready().await?;
    let socket = listener_cookies(&old.sidecar.status().await?);
    ensure!(!socket.is_empty(), "pod-0 holds no listening socket");
    let load = HttpsLoad::start(node.addr, https_client(&node.pki)?, CLIENTS);
    load.wait_progress(50).await?;

    for i in 1..=ROLLOUTS {
        // Surge: the new pod starts beside the old one and becomes ready.
        let new = Pod::start(&node, &format!("pod-{i}"), &[]).await?;
        let new_api = new.apiserver_addr().await?;
        ensure!(new_api.ip() != old_api.ip(), "both apiservers on {new_api}");
        new.wait_ready().await?;
        wait_backends(
            &new.sidecar,
            &[(new_api, "own", true), (old_api, "local", true)],
        )
        .await?;
        wait_backends(
            &old.sidecar,
            &[(old_api, "own", true), (new_api, "local", true)],
        )
        .await?;
        // The new pod took the old one's listening socket (one socket, one kernel queue).
        let shared = listener_cookies(&new.sidecar.status().await?);
        ensure!(
            shared == socket,
            "rollout {i}: {} listens on {shared:?}, not on the node's socket {socket:?}",
            new.name
        );
        load.wait_progress(50).await?;

        // The kubelet terminates the old pod: both containers at the same moment.
        let took = old.terminate().await?;
        println!("rollout {i}: {} terminated in {took:?}", old.name);
        let adopted = new
            .sidecar
            .metric_or_zero(
                "handoffs_total",
                &[("direction", "adopt_received"), ("result", "ok")],
            )
            .await?;
        ensure!(
            adopted >= 1.0,
            "{} never adopted {}'s socket",
            new.name,
            old.name
        );
        // The new pod alone carries the load, and the old pod's registration is gone.
        load.wait_progress(100).await?;
        wait_backends(&new.sidecar, &[(new_api, "own", true)]).await?;
        ensure!(
            listener_cookies(&new.sidecar.status().await?) == socket,
            "rollout {i}: the node's listening socket changed"
        );
        old = new;
        old_api = new_api;
    }
    let (ok, failures) = load.stop().await;
    report(&format!("{ROLLOUTS} rollouts"), ok, &failures)?;
    old.wait_ready().await?;

    // The last pod has no successor: end it without waiting for its drain deadline.
    old.sidecar.sigkill()?;
    old.apiserver.sigterm()?;
    println!("{ROLLOUTS} rollouts took {:?}", started.elapsed());
    Ok(())
}

/// The surge rollout, second scenario: pod 2's apiserver never becomes ready. Pod 2 never reports
/// ready (the rollout stalls) although its proxy carries traffic to pod 1's apiserver; pod 1
/// keeps serving; deleting pod 2 (rollback) loses nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rollout_with_a_never_ready_apiserver_stalls_without_loss() -> Result<()> {
    let started = Instant::now();
    let node = Node::new()?;
    let pod1 = Pod::start(&node, "pod-1", &[]).await?;
    let api1 = pod1.apiserver_addr().await?;
    pod1.wait_ready().await?;
    let load = HttpsLoad::start(node.addr, https_client(&node.pki)?, CLIENTS);
    load.wait_progress(50).await?;

    let never = node.dir.join("never-ready");
    let never_flag = format!("--ready-file={}", never.display());
    let pod2 = Pod::start(&node, "pod-2", &[never_flag.as_str()]).await?;
    let api2 = pod2.apiserver_addr().await?;
    // Pod 2's proxy serves (through pod 1's apiserver) while its own is not ready.
    pod2.sidecar.wait_state("Serving").await?;
    wait_backends(
        &pod2.sidecar,
        &[(api2, "own", false), (api1, "local", true)],
    )
    .await?;
    eventually(DEADLINE, || async {
        let accepted = pod2
            .sidecar
            .metric_or_zero("connections_accepted_total", &[])
            .await?;
        ensure!(accepted > 0.0, "pod2's proxy has accepted nothing yet");
        Ok(())
    })
    .await?;
    // The rollout waits for pod 2's probe, which keeps failing; pod 1's keeps passing. A
    // window is the only way to observe "never": 2s = 20 health intervals.
    let window = Instant::now();
    let mut probes = 0;
    while window.elapsed() < Duration::from_secs(2) {
        ensure!(
            probe(&pod2.admin_file).await? == 1,
            "pod2 reported ready after {:?}",
            window.elapsed()
        );
        ensure!(probe(&pod1.admin_file).await? == 0, "pod1 not ready");
        probes += 1;
    }
    ensure!(probes >= 2, "only {probes} probes in the window");
    load.wait_progress(50).await?;

    // The rollout is abandoned: pod 2 is deleted; its proxy hands the socket back to pod 1.
    let took = pod2.terminate().await?;
    println!("pod2 terminated in {took:?}");
    load.wait_progress(50).await?;
    wait_backends(&pod1.sidecar, &[(api1, "own", true)]).await?;
    let (ok, failures) = load.stop().await;
    report("stalled rollout", ok, &failures)?;
    ensure!(
        probe(&pod1.admin_file).await? == 0,
        "pod1 not ready at the end"
    );

    pod1.sidecar.sigkill()?;
    pod1.apiserver.sigterm()?;
    println!("stalled rollout took {:?}", started.elapsed());
    Ok(())
}
