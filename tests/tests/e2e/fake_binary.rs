//! The `fake-apiserver` binary (started as a separate process by later work): kube-apiserver
//! style flags, readiness by file, SIGTERM exits 0, and the proxy in front of it.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::HttpsClient;
use kube_apiserver_proxy_tests::util::{eventually, free_random_loopback_addr};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::{https_client, listen_addr, DEADLINE};

#[tokio::test]
async fn fake_apiserver_binary_serves_behind_the_proxy() -> Result<()> {
    let pki = Pki::new()?;
    let addr = free_random_loopback_addr()?;
    let ready_file = pki.dir().join("ready");
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_fake-apiserver"))
        .arg(format!("--bind-address={}", addr.ip()))
        .arg(format!("--secure-port={}", addr.port()))
        .arg("--tls-cert-file")
        .arg(pki.server_cert_file())
        .arg("--tls-private-key-file")
        .arg(pki.server_key_file())
        .arg("--client-ca-file")
        .arg(pki.ca_file())
        .arg("--ready-file")
        .arg(&ready_file)
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .context("spawn fake-apiserver")?;
    let client = https_client(&pki)?;
    let (status, _) = eventually(DEADLINE, || client.get(addr, "/readyz")).await?;
    ensure!(status == 503, "/readyz without the ready file: {status}");
    let anonymous = HttpsClient::new(pki.client_config(false)?);
    ensure!(
        anonymous.get(addr, "/version").await.is_err(),
        "--client-ca-file not enforced"
    );

    let listen = listen_addr()?;
    let proxy = crate::https_proxy(&pki, listen, &[])
        .arg("--backend")
        .arg(addr.to_string())
        .fast_health()
        .health_client_cert(pki.client_cert_file(), pki.client_key_file())
        .spawn()
        .await?;
    proxy.wait_state("WaitingForBackend").await?;
    std::fs::write(&ready_file, b"")?;
    proxy.wait_state("Serving").await?;
    let (status, body) = eventually(DEADLINE, || client.get(listen, "/version")).await?;
    ensure!(
        status == 200 && body.contains("gitVersion"),
        "{status} {body}"
    );

    let pid = child.id().context("fake-apiserver pid")?;
    kill(Pid::from_raw(pid as i32), Signal::SIGTERM)?;
    let status = tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .context("fake-apiserver did not exit on SIGTERM")??;
    ensure!(status.code() == Some(0), "fake-apiserver exit {status}");
    Ok(())
}
