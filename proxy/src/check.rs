//! Active health checks: one check of one backend, and the loop that runs them.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rand::Rng;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use crate::backend::{Backend, Backends};
use crate::config::{HealthCheck, HealthConfig};
use crate::health::Observation;

/// Runs one check against `backend` within `timeout`.
pub async fn check_once(
    check: &HealthCheck,
    addr: std::net::SocketAddr,
    timeout: Duration,
) -> Observation {
    match tokio::time::timeout(timeout, run_check(check, addr)).await {
        Ok(obs) => obs,
        Err(_) => Observation::Failed,
    }
}

async fn run_check(check: &HealthCheck, addr: std::net::SocketAddr) -> Observation {
    let tcp = match tokio::net::TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => return Observation::Refused,
        Err(e) if crate::net::is_local_exhaustion(&e) => return Observation::Skipped,
        Err(_) => return Observation::Failed,
    };
    let _ = tcp.set_nodelay(true);
    match check {
        HealthCheck::Tcp => Observation::Ok,
        HealthCheck::Tls { tls, server_name } => {
            match TlsConnector::from(tls.clone())
                .connect(server_name.clone(), tcp)
                .await
            {
                Ok(_) => Observation::Ok,
                Err(_) => Observation::Failed,
            }
        }
        HealthCheck::Https {
            tls,
            server_name,
            path,
        } => {
            let stream = match TlsConnector::from(tls.clone())
                .connect(server_name.clone(), tcp)
                .await
            {
                Ok(s) => s,
                Err(_) => return Observation::Failed,
            };
            https_get(stream, server_name, path).await
        }
    }
}

async fn https_get(
    stream: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    server_name: &rustls::pki_types::ServerName<'static>,
    path: &str,
) -> Observation {
    let Ok((mut sender, conn)) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream)).await
    else {
        return Observation::Failed;
    };
    let conn = tokio::spawn(conn);
    let host = match server_name {
        rustls::pki_types::ServerName::DnsName(n) => n.as_ref().to_string(),
        other => format!("{other:?}"),
    };
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, host)
        .header(
            hyper::header::USER_AGENT,
            concat!("kube-apiserver-proxy/", env!("CARGO_PKG_VERSION")),
        )
        .body(Empty::new());
    let Ok(req) = req else {
        return Observation::Failed;
    };
    let obs = match sender.send_request(req).await {
        Ok(resp) if resp.status() == hyper::StatusCode::OK => Observation::Ok,
        Ok(_) => Observation::NotReady,
        Err(_) => Observation::Failed,
    };
    conn.abort();
    obs
}

/// Checks `backend` every interval (with up to 10% jitter) until `stop`; the first check runs at once.
pub async fn run_loop(
    backend: Arc<Backend>,
    backends: Arc<Backends>,
    health: HealthConfig,
    stop: CancellationToken,
) {
    loop {
        let obs = tokio::select! {
            obs = check_once(&health.check, backend.addr.0, health.timeout) => obs,
            _ = stop.cancelled() => return,
        };
        tracing::trace!(backend = %backend.addr, result = obs.as_str(), "health check");
        if backend.observe(obs).is_some() {
            backends.notify();
        }
        let jitter = health
            .interval
            .mul_f64(rand::thread_rng().gen_range(0.0..0.1));
        tokio::select! {
            _ = tokio::time::sleep(health.interval + jitter) => {}
            _ = stop.cancelled() => return,
        }
    }
}
