//! `--client-address transparent`: the backend sees each client's own address, clients on the
//! node and of the other family are connected normally, a missing policy routing is a
//! fallback (counted, logged once, in `/status`), never a failed client; `transparent-routes`
//! is idempotent; `--user` keeps only `CAP_NET_RAW`, and the in-place upgrade and the listener
//! handoff carry transparent connections.
//!
//! Each test runs in a private network namespace (`handoff::run_in_netns`) with a second one
//! for the clients, joined by a veth pair (`kube_apiserver_proxy_tests::netns`): the clients'
//! addresses are not the node's, so the backend's answers reach the proxy only through the
//! policy routing. They need root; without it they fail in CI and say they are skipped
//! elsewhere.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use kube_apiserver_proxy_tests::netns::{
    route_is_local, seen_from_node, ClientNet, WhoAmI, CLIENT_V4, CLIENT_V6, NODE_V4, NODE_V6,
};
use kube_apiserver_proxy_tests::proxy::{proxy_bin, Proxy, ProxyBuilder};
use kube_apiserver_proxy_tests::util::{eventually, free_addr, random_loopback_ip, TempDir};

use crate::handoff::run_in_netns;
use crate::upgrade::{install_binary, upgrade, wait_gone, PidGuard};
use crate::{serving, DEADLINE};

/// How long a backend may take to verify (its verification runs every 5 s).
const VERIFIED: Duration = Duration::from_secs(20);
const LOCALHOST: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
/// The uid the proxy switches to with `--user` (the manifests' proxy uid).
const PROXY_UID: u32 = 59443;

fn inside() -> Result<()> {
    ensure!(
        std::env::var_os("KAP_TEST_IN_NETNS").is_some(),
        "this test runs only inside the network namespace set up by its wrapper"
    );
    Ok(())
}

/// Runs `kube-apiserver-proxy transparent-routes ARGS`: (exit code, stdout).
fn transparent_routes(args: &[&str]) -> Result<(i32, String)> {
    let out = std::process::Command::new(proxy_bin()?)
        .arg("transparent-routes")
        .args(args)
        .output()?;
    Ok(kube_apiserver_proxy_tests::process::code_and_output(&out))
}

/// Installs the routing and checks that it said so.
fn install_routes() -> Result<()> {
    let (code, out) = transparent_routes(&[])?;
    ensure!(code == 0, "transparent-routes exited {code}: {out}");
    Ok(())
}

/// The clients' namespace, a backend on a random 127.a.b.c, and the node's listen address.
struct Setup {
    net: ClientNet,
    backend: WhoAmI,
    listen: SocketAddr,
}

impl Setup {
    async fn new() -> Result<Self> {
        inside()?;
        let net = ClientNet::new()?;
        let backend = WhoAmI::start(SocketAddr::new(random_loopback_ip()?, 0)).await?;
        let listen = free_addr(NODE_V4.parse()?)?;
        Ok(Setup {
            net,
            backend,
            listen,
        })
    }

    fn proxy(&self) -> ProxyBuilder {
        ProxyBuilder::tcp(self.listen, self.backend.addr()).arg("--client-address=transparent")
    }
}

/// What `/status` says the backend sees.
async fn backend_sees(proxy: &Proxy, backend: SocketAddr) -> Result<String> {
    let status = proxy.backend_status(backend).await?;
    Ok(status["client_address"].as_str().unwrap_or("").to_string())
}

/// Waits until `/status` says connections to `backend` are transparent.
async fn wait_verified(proxy: &Proxy, backend: SocketAddr) -> Result<()> {
    eventually(VERIFIED, || async {
        let sees = backend_sees(proxy, backend).await?;
        ensure!(sees == "transparent: works", "backend: {sees}");
        Ok(())
    })
    .await
}

async fn counted(proxy: &Proxy, result: &str) -> Result<f64> {
    proxy
        .metric_or_zero("client_address_connections_total", &[("result", result)])
        .await
}

/// `Uid:` and the capability lines of `/proc/PID/status`.
fn credentials(pid: u32) -> Result<(String, String, String, String)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok((
        field("Uid:")?,
        field("CapEff:")?,
        field("CapPrm:")?,
        field("CapAmb:")?,
    ))
}

/// Only CAP_NET_RAW (bit 13), effective, permitted and ambient, as uid 59443.
fn ensure_only_net_raw(pid: u32) -> Result<()> {
    let (uid, eff, prm, amb) = credentials(pid)?;
    ensure!(
        uid == format!("{PROXY_UID} {PROXY_UID} {PROXY_UID} {PROXY_UID}"),
        "pid {pid} uids {uid}"
    );
    for (set, value) in [("effective", eff), ("permitted", prm), ("ambient", amb)] {
        ensure!(
            value == "0000000000002000",
            "pid {pid}: {set} capabilities {value}, want CAP_NET_RAW alone"
        );
    }
    Ok(())
}

#[test]
fn clients_keep_their_address_and_fall_back_without_the_routing() -> Result<()> {
    run_in_netns("transparent::inner_clients_keep_their_address_and_fall_back_without_the_routing")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a private network namespace: see its wrapper without the inner_ prefix"]
async fn inner_clients_keep_their_address_and_fall_back_without_the_routing() -> Result<()> {
    let s = Setup::new().await?;
    let listen6 = free_addr(NODE_V6.parse()?)?;
    let loopback = free_addr(LOCALHOST)?;
    let backend = s.backend.addr();
    let proxy = serving(s.proxy().listen(listen6).listen(loopback)).await?;

    // No policy routing yet: the backend does not verify, and a client off the node is carried
    // all the same, connected normally: counted, said once, shown in /status; still ready.
    eventually(VERIFIED, || async {
        let sees = backend_sees(&proxy, backend).await?;
        ensure!(
            sees.contains("fails: the answers are not routed back"),
            "backend: {sees}"
        );
        Ok(())
    })
    .await?;
    let (seen, _) = s.net.seen_as(CLIENT_V4[0], s.listen)?;
    ensure!(
        seen == LOCALHOST,
        "without the routing the backend saw {seen}"
    );
    ensure!(counted(&proxy, "fallback").await? == 1.0);
    ensure!(proxy.admin_get("/readyz").await?.0 == 200, "not ready");

    // The routing, installed twice: added, then present, both exit 0.
    let (code, out) = transparent_routes(&[])?;
    ensure!(
        code == 0 && out.matches("added: ").count() == 5,
        "first run, exit {code}:\n{out}"
    );
    let (code, again) = transparent_routes(&[])?;
    ensure!(
        code == 0 && again.matches("present: ").count() == 5 && !again.contains("added"),
        "second run, exit {code}:\n{again}"
    );
    // Answers from the backend's address to a client's are local now; from 127.0.0.x they are
    // not (the host's own traffic, kube-proxy's localhost NodePorts, keeps its routes).
    let backend_ip = backend.ip().to_string();
    ensure!(route_is_local(&backend_ip, CLIENT_V4[0])?);
    ensure!(!route_is_local("127.0.0.1", CLIENT_V4[0])?);

    wait_verified(&proxy, backend).await?;
    for client in CLIENT_V4 {
        let (seen, _) = s.net.seen_as(client, s.listen)?;
        ensure!(
            seen.to_string() == client,
            "client {client}: the backend saw {seen}"
        );
    }
    ensure!(counted(&proxy, "transparent").await? == 2.0);
    // On the node (its own address, loopback) and of the other family: connected normally,
    // not counted as a fallback.
    for (what, seen) in [
        ("the node's address", seen_from_node(s.listen)?.0),
        ("loopback", seen_from_node(loopback)?.0),
        ("IPv6", s.net.seen_as(CLIENT_V6, listen6)?.0),
    ] {
        ensure!(
            seen == LOCALHOST,
            "a client on {what}: the backend saw {seen}"
        );
    }
    ensure!(counted(&proxy, "fallback").await? == 1.0);
    let said = proxy
        .stderr()
        .matches("client address: connecting normally")
        .count();
    ensure!(said == 1, "the fallback was logged {said} times");

    // The routing removed under the proxy's feet: the next clients still connect (a
    // transparent connect that gets no answer is made again normally), and the backend goes
    // back to the fallback.
    let (code, out) = transparent_routes(&["--remove"])?;
    ensure!(
        code == 0 && out.matches("removed: ").count() == 5,
        "--remove, exit {code}:\n{out}"
    );
    for client in CLIENT_V4 {
        let (seen, _) = s.net.seen_as(client, s.listen)?;
        ensure!(seen == LOCALHOST, "after removal the backend saw {seen}");
    }
    eventually(VERIFIED, || async {
        let sees = backend_sees(&proxy, backend).await?;
        ensure!(sees.contains("fails"), "backend: {sees}");
        Ok(())
    })
    .await?;
    ensure!(proxy.admin_get("/readyz").await?.0 == 200, "not ready");
    ensure!(
        proxy
            .metric_or_zero("connections_failed_total", &[("reason", "no_backend")])
            .await?
            == 0.0,
        "a client was turned away"
    );
    Ok(())
}

#[test]
fn a_backend_in_the_hosts_range_never_verifies() -> Result<()> {
    run_in_netns("transparent::inner_a_backend_in_the_hosts_range_never_verifies")
}

/// A backend in 127.0.0.0/24 found at run time (the own backend's file; as `--backend` it is
/// refused at start, `cli`): the routing leaves that range to the host, so the backend's
/// answers to a client on the node's network never come back, whatever a connection from the
/// documentation address (no route to it in this namespace) would show. It fails its
/// verification at once, saying why, and each client off the node is connected normally
/// without waiting out the connect timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a private network namespace: see its wrapper without the inner_ prefix"]
async fn inner_a_backend_in_the_hosts_range_never_verifies() -> Result<()> {
    inside()?;
    let net = ClientNet::new()?;
    install_routes()?;
    let backend = WhoAmI::start(SocketAddr::new(Ipv4Addr::new(127, 0, 0, 77).into(), 0)).await?;
    let listen = free_addr(NODE_V4.parse()?)?;
    let dir = TempDir::new("transparent-host-range")?;
    let own = dir.join("address");
    std::fs::write(&own, backend.addr().to_string())?;
    let connect_timeout = Duration::from_secs(10);
    let proxy = serving(
        ProxyBuilder::new()
            .listen(listen)
            .arg("--own-backend-file")
            .arg(&own)
            .health_check("tcp")
            .fast_health()
            .arg("--client-address=transparent")
            .arg(format!("--connect-timeout={}s", connect_timeout.as_secs())),
    )
    .await?;
    eventually(VERIFIED, || async {
        let sees = backend_sees(&proxy, backend.addr()).await?;
        ensure!(
            sees.contains("fails: the backend is in 127.0.0.0/24"),
            "backend: {sees}"
        );
        Ok(())
    })
    .await?;
    for client in CLIENT_V4 {
        let started = std::time::Instant::now();
        let (seen, _) = net.seen_as(client, listen)?;
        ensure!(seen == LOCALHOST, "client {client}: the backend saw {seen}");
        ensure!(
            started.elapsed() < connect_timeout / 2,
            "client {client} waited {:?}",
            started.elapsed()
        );
    }
    ensure!(counted(&proxy, "fallback").await? == 2.0);
    ensure!(counted(&proxy, "transparent").await? == 0.0);
    Ok(())
}

#[test]
fn user_keeps_only_net_raw_and_upgrades_in_place() -> Result<()> {
    run_in_netns("transparent::inner_user_keeps_only_net_raw_and_upgrades_in_place")
}

/// Started as root with `--user`, the proxy runs as the proxy's uid with CAP_NET_RAW alone;
/// its successor of an in-place upgrade has the same, carries on the established transparent
/// connection and makes new ones transparently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a private network namespace: see its wrapper without the inner_ prefix"]
async fn inner_user_keeps_only_net_raw_and_upgrades_in_place() -> Result<()> {
    let s = Setup::new().await?;
    install_routes()?;
    let dir = TempDir::new("transparent-upgrade")?;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
    std::fs::create_dir_all(dir.join("bin"))?;
    let bin = dir.join("bin").join("kube-apiserver-proxy");
    install_binary(&bin, "")?;
    let handoff = dir.join("handoff");
    std::fs::create_dir(&handoff)?;
    std::fs::set_permissions(&handoff, std::fs::Permissions::from_mode(0o700))?;
    nix::unistd::chown(
        &handoff,
        Some(nix::unistd::Uid::from_raw(PROXY_UID)),
        Some(nix::unistd::Gid::from_raw(PROXY_UID)),
    )?;
    let first = serving(
        s.proxy()
            .bin(&bin)
            .arg("--handoff-dir")
            .arg(&handoff)
            .drain_timeout(Duration::from_secs(10))
            .switch_user(PROXY_UID),
    )
    .await?;
    let pid = first.pid();
    ensure_only_net_raw(pid)?;
    wait_verified(&first, s.backend.addr()).await?;
    let (seen, mut established) = s.net.seen_as(CLIENT_V4[0], s.listen)?;
    ensure!(seen.to_string() == CLIENT_V4[0], "the backend saw {seen}");
    established.round_trip(b"before")?;

    let successor = upgrade(pid, first.admin_addr()).await?;
    let _guard = PidGuard(successor);
    ensure_only_net_raw(successor)?;
    wait_gone(pid).await?;
    // The connection made with the client's address lives on in the successor.
    established.round_trip(b"after the upgrade")?;
    // The successor verifies on its own and connects new clients with their address.
    eventually(VERIFIED, || async {
        let (seen, _) = s.net.seen_as(CLIENT_V4[1], s.listen)?;
        ensure!(
            seen.to_string() == CLIENT_V4[1],
            "the successor's backend saw {seen}"
        );
        Ok(())
    })
    .await?;
    Ok(())
}

#[test]
fn listener_handoff_keeps_the_client_address() -> Result<()> {
    run_in_netns("transparent::inner_listener_handoff_keeps_the_client_address")
}

/// A second instance shares the listener, the first hands it over at its drain (adopt): a
/// connection the first made transparently lives until it ends, the new instance's are
/// transparent too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a private network namespace: see its wrapper without the inner_ prefix"]
async fn inner_listener_handoff_keeps_the_client_address() -> Result<()> {
    let s = Setup::new().await?;
    install_routes()?;
    let dir = TempDir::new("transparent-handoff")?;
    let handoff = dir.join("handoff");
    let instance = || {
        s.proxy()
            .arg("--handoff-dir")
            .arg(&handoff)
            .drain_timeout(Duration::from_secs(10))
    };
    let old = serving(instance()).await?;
    wait_verified(&old, s.backend.addr()).await?;
    let (seen, mut established) = s.net.seen_as(CLIENT_V4[0], s.listen)?;
    ensure!(seen.to_string() == CLIENT_V4[0], "the backend saw {seen}");

    let new = serving(instance()).await?;
    wait_verified(&new, s.backend.addr()).await?;
    old.sigterm()?;
    // The old instance drains: its listener goes to the new one, its connection stays.
    eventually(DEADLINE, || async {
        ensure!(
            new.metric_or_zero(
                "handoffs_total",
                &[("direction", "adopt_received"), ("result", "ok")]
            )
            .await?
                >= 1.0,
            "no adoption yet"
        );
        Ok(())
    })
    .await?;
    established.round_trip(b"during the drain")?;
    for client in CLIENT_V4 {
        let (seen, _) = s.net.seen_as(client, s.listen)?;
        ensure!(
            seen.to_string() == client,
            "after the handoff the backend saw {seen}"
        );
    }
    drop(established);
    let status = old.wait_exit(Duration::from_secs(15)).await?;
    ensure!(status.success(), "old instance: {status}");
    ensure!(counted(&new, "fallback").await? == 0.0);
    Ok(())
}

/// Runs `iptables ARGS` (in the test's namespace).
fn iptables(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new("iptables").args(args).output()?;
    ensure!(
        out.status.success(),
        "iptables {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

#[test]
fn the_kubelets_firewall_rule_is_a_fallback_until_excepted() -> Result<()> {
    let name = "transparent::inner_the_kubelets_firewall_rule_is_a_fallback_until_excepted";
    let found = std::process::Command::new("iptables")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        return kube_apiserver_proxy_tests::util::skip(
            name,
            "iptables not found (apt-get install iptables)",
        );
    }
    run_in_netns(name)
}

/// The kubelet's (and kube-proxy's) `KUBE-FIREWALL` rule drops a packet to 127.0.0.0/8 from
/// any other address: the backend does not verify, for that reason, and clients are carried
/// normally. The two rules docs/operations.md gives, before it, let the mode work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "runs inside a private network namespace: see its wrapper without the inner_ prefix"]
async fn inner_the_kubelets_firewall_rule_is_a_fallback_until_excepted() -> Result<()> {
    let s = Setup::new().await?;
    install_routes()?;
    // As the kubelet makes it (pkg/kubelet/kubelet_network_linux.go).
    iptables(&["-N", "KUBE-FIREWALL"])?;
    iptables(&["-I", "OUTPUT", "1", "-j", "KUBE-FIREWALL"])?;
    iptables(&["-I", "INPUT", "1", "-j", "KUBE-FIREWALL"])?;
    iptables(&[
        "-A",
        "KUBE-FIREWALL",
        "-m",
        "comment",
        "--comment",
        "block incoming localnet connections",
        "--dst",
        "127.0.0.0/8",
        "!",
        "--src",
        "127.0.0.0/8",
        "-m",
        "conntrack",
        "!",
        "--ctstate",
        "RELATED,ESTABLISHED,DNAT",
        "-j",
        "DROP",
    ])?;
    let backend = s.backend.addr();
    let proxy = serving(s.proxy()).await?;
    eventually(VERIFIED, || async {
        let sees = backend_sees(&proxy, backend).await?;
        ensure!(sees.contains("a firewall rule drops it"), "backend: {sees}");
        Ok(())
    })
    .await?;
    let (seen, _) = s.net.seen_as(CLIENT_V4[0], s.listen)?;
    ensure!(
        seen == LOCALHOST,
        "behind the firewall rule the backend saw {seen}"
    );
    ensure!(proxy.admin_get("/readyz").await?.0 == 200, "not ready");

    // docs/operations.md, "What the apiserver sees", point 3.
    iptables(&[
        "-I",
        "OUTPUT",
        "1",
        "-o",
        "lo",
        "-d",
        "127.0.0.0/8",
        "!",
        "-s",
        "127.0.0.0/8",
        "-p",
        "tcp",
        "-j",
        "ACCEPT",
    ])?;
    iptables(&[
        "-I",
        "INPUT",
        "1",
        "-i",
        "lo",
        "-d",
        "127.0.0.0/8",
        "!",
        "-s",
        "127.0.0.0/8",
        "-p",
        "tcp",
        "-j",
        "ACCEPT",
    ])?;
    wait_verified(&proxy, backend).await?;
    let (seen, _) = s.net.seen_as(CLIENT_V4[0], s.listen)?;
    ensure!(
        seen.to_string() == CLIENT_V4[0],
        "with the exception the backend saw {seen}"
    );
    Ok(())
}
