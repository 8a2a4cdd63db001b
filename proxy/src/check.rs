//! Active health checks: their configuration, one check of one backend, and the loop that runs
//! them. The loop reports each result through a callback; it knows nothing of the backend set.

use std::io;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use rand::Rng;
use tokio_rustls::TlsConnector;
use tokio_util::sync::CancellationToken;

use crate::health::Observation;

/// How the active health check reaches a backend.
#[derive(Clone)]
pub enum HealthCheck {
    /// TLS handshake then `GET path`; 200 means ready.
    Https {
        tls: Arc<rustls::ClientConfig>,
        server_name: rustls::pki_types::ServerName<'static>,
        path: String,
    },
    /// TLS handshake only.
    Tls {
        tls: Arc<rustls::ClientConfig>,
        server_name: rustls::pki_types::ServerName<'static>,
    },
    /// TCP connect only.
    Tcp,
}

impl std::fmt::Debug for HealthCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HealthCheck::Https { path, .. } => write!(f, "https {path}"),
            HealthCheck::Tls { .. } => write!(f, "tls"),
            HealthCheck::Tcp => write!(f, "tcp"),
        }
    }
}

/// Health check timing and thresholds.
#[derive(Debug, Clone)]
pub struct HealthConfig {
    /// What a check does.
    pub check: HealthCheck,
    /// Time between checks of one backend (default 2s), jittered by up to 10%.
    pub interval: Duration,
    /// Time one check may take (default 1s).
    pub timeout: Duration,
    /// Consecutive passes before healthy (default 2).
    pub rise: NonZeroU32,
    /// Consecutive failures before unhealthy; refused this often: dead (default 3).
    pub fall: NonZeroU32,
}

/// What one check found, and why when it did not pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    pub obs: Observation,
    /// The cause of a failure, for the log and `/status` (`None` when the check passed).
    pub cause: Option<String>,
}

impl CheckResult {
    fn ok() -> Self {
        CheckResult {
            obs: Observation::Ok,
            cause: None,
        }
    }

    fn fail(obs: Observation, cause: impl Into<String>) -> Self {
        CheckResult {
            obs,
            cause: Some(cause.into()),
        }
    }
}

/// Runs one check against `addr` within `timeout`.
pub async fn check_once(
    check: &HealthCheck,
    addr: std::net::SocketAddr,
    timeout: Duration,
) -> CheckResult {
    match tokio::time::timeout(timeout, run_check(check, addr)).await {
        Ok(result) => result,
        Err(_) => CheckResult::fail(
            Observation::Failed,
            format!("no answer within {timeout:?} (--health-timeout)"),
        ),
    }
}

async fn run_check(check: &HealthCheck, addr: std::net::SocketAddr) -> CheckResult {
    let tcp = match tokio::net::TcpStream::connect(addr).await {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            return CheckResult::fail(Observation::Refused, format!("connect: {e}"))
        }
        Err(e) if crate::net::is_local_exhaustion(&e) => {
            return CheckResult::fail(Observation::Skipped, format!("no descriptor here: {e}"))
        }
        Err(e) => return CheckResult::fail(Observation::Failed, format!("connect: {e}")),
    };
    let _ = tcp.set_nodelay(true);
    match check {
        HealthCheck::Tcp => CheckResult::ok(),
        HealthCheck::Tls { tls, server_name } => {
            match TlsConnector::from(tls.clone())
                .connect(server_name.clone(), tcp)
                .await
            {
                Ok(_) => CheckResult::ok(),
                Err(e) => CheckResult::fail(Observation::Failed, format!("tls handshake: {e}")),
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
                Err(e) => {
                    return CheckResult::fail(Observation::Failed, format!("tls handshake: {e}"))
                }
            };
            https_get(stream, server_name, path).await
        }
    }
}

async fn https_get(
    stream: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    server_name: &rustls::pki_types::ServerName<'static>,
    path: &str,
) -> CheckResult {
    let (mut sender, conn) = match hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(
        TokioIo::new(stream),
    )
    .await
    {
        Ok(h) => h,
        Err(e) => return CheckResult::fail(Observation::Failed, format!("http: {e}")),
    };
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
    let req = match req {
        Ok(r) => r,
        Err(e) => return CheckResult::fail(Observation::Failed, format!("GET {path}: {e}")),
    };
    // The connection is driven here, beside the request, rather than on a task of its own.
    let response = tokio::select! {
        r = sender.send_request(req) => r,
        r = conn => {
            let why = r.err().map(|e| e.to_string()).unwrap_or_else(|| "connection closed".into());
            return CheckResult::fail(Observation::Failed, format!("GET {path}: {why}"));
        }
    };
    match response {
        Ok(resp) if resp.status() == hyper::StatusCode::OK => CheckResult::ok(),
        // 4xx: the apiserver refuses the request itself (no access for the check's identity, a
        // wrong path); that is a failing check, not an apiserver saying it is not ready.
        Ok(resp) if resp.status().is_client_error() => CheckResult::fail(
            Observation::Failed,
            format!(
                "GET {path}: HTTP {} (check --health-path and the check's credentials)",
                resp.status()
            ),
        ),
        Ok(resp) => CheckResult::fail(
            Observation::NotReady,
            format!("GET {path}: HTTP {}", resp.status()),
        ),
        Err(e) => CheckResult::fail(Observation::Failed, format!("GET {path}: {e}")),
    }
}

/// Checks `addr` every interval (with up to 10% jitter) until `stop`, handing every result to
/// `report`; the first check runs at once.
pub async fn run_loop(
    addr: SocketAddr,
    health: HealthConfig,
    report: impl Fn(CheckResult) + Send,
    stop: CancellationToken,
) {
    loop {
        let result = tokio::select! {
            r = check_once(&health.check, addr, health.timeout) => r,
            _ = stop.cancelled() => return,
        };
        tracing::trace!(backend = %addr, result = result.obs.as_str(), "health check");
        report(result);
        let jitter = health
            .interval
            .mul_f64(rand::thread_rng().gen_range(0.0..0.1));
        tokio::select! {
            _ = tokio::time::sleep(health.interval + jitter) => {}
            _ = stop.cancelled() => return,
        }
    }
}
