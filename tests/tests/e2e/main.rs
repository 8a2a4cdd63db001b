//! End-to-end tests of the `kube-apiserver-proxy` binary: real child processes, real sockets
//! on loopback, real TLS, against the fakes of `kube_apiserver_proxy_tests`.
//!
//! One module per feature:
//! - `cli`: bad input (exit 2, one line, nothing bound), `--help`, env vars, default subcommand.
//! - `listening`: SO_REUSEPORT sharing, listener bound only once a backend is healthy.
//! - `forwarding`: byte-exact copy, TLS with client certs, half-close, no idle timeout,
//!   `--max-connections`, IPv6, socket options on both sides.
//! - `health`: https/tls/tcp checks, rise/fall, passive failure retry, not-ready vs dead,
//!   fail-open, least-connections selection.
//! - `lifecycle`: SIGTERM/SIGINT drain and exit codes, lifecycle log lines.
//! - `in_process`: the library's start/serve/drain driven in-process, shutdown injected on the
//!   instance's intent channel: states in order, listener closed, in-flight connection done.
//! - `admin`: `/healthz`, `/readyz`, `/metrics`, `/status`, `probe`.
//! - `monitoring`: the node's scrape endpoint (`--metrics-listen`), series of removed backends,
//!   `/peer-ready` with `probe --wait` (the pods' preStop hooks).
//! - `fake_binary`: the `fake-apiserver` binary behind the proxy.
//! - `upgrade`: in-place upgrade on SIGUSR2 (`systemctl reload`) to a replaced binary.
//! - `migrate`: moving the node address off a wildcard listener (kubeadm's apiserver).
//! - `kubeadm_sync`: the node agent of a migrated controller: copies, rollouts, the stand-in.
//! - `render`: `render` on manifests written by the real kubeadm: nothing lost, older images refused.
//! - `transparent`: `--client-address transparent` with clients in another network namespace,
//!   `transparent-routes`, `--user`, and the upgrade and handoff in that mode.
//! - `recovery`: reboot recovery: the checkpoint writer, the recovery instance's retirement,
//!   the `recover` node agent.

mod admin;
mod cli;
mod fake_binary;
mod forwarding;
mod handoff;
mod health;
mod in_process;
mod kubeadm_sync;
mod launch;
mod lifecycle;
mod listening;
mod manifests;
mod migrate;
mod monitoring;
mod pod;
mod recovery;
mod reliability;
mod render;
mod runbooks;
mod static_binary;
mod transparent;
mod upgrade;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Result;
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::{HttpsClient, TcpClient};
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::proxy::{Proxy, ProxyBuilder};
use kube_apiserver_proxy_tests::util::{eventually, free_random_loopback_addr};

/// Deadline for conditions that should hold "soon" (start-up, state changes).
pub const DEADLINE: Duration = Duration::from_secs(10);

/// An https fake apiserver on a random loopback address, ready.
pub async fn https_backend(pki: &Pki) -> Result<FakeApiserver> {
    FakeApiserver::https(pki).random_loopback()?.start().await
}

/// An https fake apiserver on a random loopback address whose /readyz answers 503.
pub async fn https_backend_unready(pki: &Pki) -> Result<FakeApiserver> {
    FakeApiserver::https(pki)
        .random_loopback()?
        .ready(false)
        .start()
        .await
}

/// An https fake apiserver on a random loopback address that requires a client certificate
/// of `pki`.
pub async fn https_backend_requiring_client_cert(pki: &Pki) -> Result<FakeApiserver> {
    FakeApiserver::https(pki)
        .random_loopback()?
        .require_client_cert(pki.ca.root_store()?)
        .start()
        .await
}

/// A proxy (https checks, fast timings) started on a fresh address before its one backend is
/// ready: the backend, the address, the proxy.
pub async fn proxy_before_its_backend(pki: &Pki) -> Result<(FakeApiserver, SocketAddr, Proxy)> {
    let backend = https_backend_unready(pki).await?;
    let listen = listen_addr()?;
    let proxy = https_proxy(pki, listen, &[&backend])
        .fast_health()
        .spawn()
        .await?;
    Ok((backend, listen, proxy))
}

/// A raw TCP echo backend on a random loopback address.
pub async fn echo_backend() -> Result<FakeApiserver> {
    FakeApiserver::tcp_echo().random_loopback()?.start().await
}

/// A raw TCP echo backend and a proxy in front of it on a fresh address (tcp checks, fast
/// timings), Serving: the backend, the address, the proxy.
pub async fn echo_proxy() -> Result<(FakeApiserver, SocketAddr, Proxy)> {
    echo_proxy_with(|builder| builder).await
}

/// [`echo_proxy`], with the proxy's builder passed through `configure` first (more flags, a
/// descriptor limit).
pub async fn echo_proxy_with(
    configure: impl FnOnce(ProxyBuilder) -> ProxyBuilder,
) -> Result<(FakeApiserver, SocketAddr, Proxy)> {
    let backend = echo_backend().await?;
    let listen = listen_addr()?;
    let proxy = serving(configure(tcp_proxy(listen, &[&backend]).fast_health())).await?;
    Ok((backend, listen, proxy))
}

/// A proxy with https checks against `pki`'s CA (timings not set).
pub fn https_proxy(pki: &Pki, listen: SocketAddr, backends: &[&FakeApiserver]) -> ProxyBuilder {
    backends
        .iter()
        .fold(ProxyBuilder::new().listen(listen), |b, fake| {
            b.backend(fake.addr())
        })
        .health_check("https")
        .ca_file(&pki.ca_file())
}

/// A proxy with tcp checks (timings not set).
pub fn tcp_proxy(listen: SocketAddr, backends: &[&FakeApiserver]) -> ProxyBuilder {
    backends
        .iter()
        .fold(ProxyBuilder::new().listen(listen), |b, fake| {
            b.backend(fake.addr())
        })
        .health_check("tcp")
}

/// Spawns `builder` and waits for `Serving`.
pub async fn serving(builder: ProxyBuilder) -> Result<Proxy> {
    let proxy = builder.spawn().await?;
    proxy.wait_state("Serving").await?;
    Ok(proxy)
}

/// A fresh listen address for a proxy.
pub fn listen_addr() -> Result<SocketAddr> {
    free_random_loopback_addr()
}

/// An HTTPS client for `pki` (with its client certificate).
pub fn https_client(pki: &Pki) -> Result<HttpsClient> {
    Ok(HttpsClient::new(pki.client_config(true)?))
}

/// Connects through `addr` until an echo round trip succeeds (the proxy may still be binding).
pub async fn connect_echo(addr: SocketAddr) -> Result<TcpClient> {
    eventually(DEADLINE, || async {
        let mut client = TcpClient::connect(addr).await?;
        client.round_trip(b"hello").await?;
        Ok(client)
    })
    .await
}
