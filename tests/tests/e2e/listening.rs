//! Listening: SO_REUSEPORT lets two instances share one address; the public listener is
//! bound only once a backend has passed its health check.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::TcpClient;
use kube_apiserver_proxy_tests::util::{connection_refused, eventually};

use crate::proxy_before_its_backend;
use crate::{echo_proxy, https_client, serving, tcp_proxy, DEADLINE};

#[tokio::test]
async fn two_instances_share_one_listen_address() -> Result<()> {
    let (backend, listen, first) = echo_proxy().await?;
    let second = serving(tcp_proxy(listen, &[&backend]).fast_health()).await?;
    for i in 0..40u32 {
        let mut client = TcpClient::connect(listen).await?;
        client.round_trip(&i.to_be_bytes()).await?;
    }
    // The kernel spreads new connections over both reuseport members.
    let accepted_first = first
        .metric_or_zero("connections_accepted_total", &[])
        .await?;
    let accepted_second = second
        .metric_or_zero("connections_accepted_total", &[])
        .await?;
    ensure!(
        accepted_first > 0.0 && accepted_second > 0.0,
        "both instances should accept: {accepted_first} and {accepted_second}"
    );
    ensure!(
        accepted_first + accepted_second >= 40.0,
        "accepted {accepted_first} + {accepted_second} < 40"
    );
    Ok(())
}

#[tokio::test]
async fn listener_bound_only_after_backend_is_ready() -> Result<()> {
    let pki = Pki::new()?;
    let (backend, listen, proxy) = proxy_before_its_backend(&pki).await?;
    // Several checks answered 503 …
    eventually(DEADLINE, || async {
        proxy.ensure_running()?;
        let not_ready = proxy
            .metric_or_zero("health_checks_total", &[("result", "not_ready")])
            .await?;
        ensure!(not_ready >= 3.0, "{not_ready} not_ready checks so far");
        Ok(())
    })
    .await?;
    // … and still nothing accepts on the listen address.
    ensure!(
        connection_refused(listen).await,
        "{listen} accepts connections while the only backend is unready"
    );
    ensure!(
        proxy.state().await? == "WaitingForBackend",
        "state {}",
        proxy.state().await?
    );

    backend.set_ready(true);
    let ready_at = Instant::now();
    let client = https_client(&pki)?;
    let (status, _) = eventually(DEADLINE, || client.get(listen, "/version")).await?;
    ensure!(status == 200, "/version through the proxy: {status}");
    // Within about one health interval (100ms), with generous slack for a loaded machine.
    ensure!(
        ready_at.elapsed() < Duration::from_secs(2),
        "serving only {:?} after the backend turned ready",
        ready_at.elapsed()
    );
    Ok(())
}
