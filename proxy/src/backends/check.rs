//! Active health checks: their configuration, one check of one backend, and the loop that runs
//! them. The loop reports each result through a callback; it knows nothing of the backend set.

use std::io;
use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::backends::health::Observation;
use crate::base::http_client::{self, HttpError};

/// Largest answer an https check reads (a `/readyz` answer is a few lines).
const MAX_BODY: usize = 1 << 20;

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

#[cfg(test)]
impl HealthConfig {
    /// TCP checks every second, one pass to rise and one failure to fall: the tests' backends.
    pub(crate) fn tcp_for_tests() -> Self {
        HealthConfig {
            check: HealthCheck::Tcp,
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            rise: NonZeroU32::MIN,
            fall: NonZeroU32::MIN,
        }
    }
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
pub async fn check_once(check: &HealthCheck, addr: SocketAddr, timeout: Duration) -> CheckResult {
    match tokio::time::timeout(timeout, run_check(check, addr)).await {
        Ok(result) => result,
        Err(_) => CheckResult::fail(
            Observation::Failed,
            format!("no answer within {timeout:?} (--health-timeout)"),
        ),
    }
}

async fn run_check(check: &HealthCheck, addr: SocketAddr) -> CheckResult {
    match attempt(check, addr).await {
        Ok(None) => CheckResult::ok(),
        Ok(Some((path, status))) => classify_status(path, status),
        Err(e) => classify_error(e),
    }
}

/// Why a check did not get as far as an answer's status.
#[derive(Debug, thiserror::Error)]
enum CheckError {
    #[error(transparent)]
    Reach(HttpError),
    #[error("GET {path}: {source}")]
    Get {
        path: String,
        #[source]
        source: HttpError,
    },
}

/// Connects (and shakes hands, and GETs) as `check` says: the path and status of the answer
/// for an https check, `None` for the others once connected.
async fn attempt(
    check: &HealthCheck,
    addr: SocketAddr,
) -> Result<Option<(&str, hyper::StatusCode)>, CheckError> {
    let tcp = http_client::connect(addr)
        .await
        .map_err(CheckError::Reach)?;
    #[cfg(feature = "planted-faults")]
    if matches!(check, HealthCheck::Https { .. }) {
        crate::fault::at_https_check(&tcp);
    }
    match check {
        HealthCheck::Tcp => Ok(None),
        HealthCheck::Tls { tls, server_name } => {
            http_client::tls(tls.clone(), server_name.clone(), tcp)
                .await
                .map_err(CheckError::Reach)?;
            Ok(None)
        }
        HealthCheck::Https {
            tls,
            server_name,
            path,
        } => {
            let stream = http_client::tls(tls.clone(), server_name.clone(), tcp)
                .await
                .map_err(CheckError::Reach)?;
            let get = |source| CheckError::Get {
                path: path.clone(),
                source,
            };
            let host = match server_name {
                rustls::pki_types::ServerName::DnsName(n) => n.as_ref().to_string(),
                other => format!("{other:?}"),
            };
            let req = hyper::Request::get(path.as_str())
                .header(hyper::header::HOST, host)
                .header(
                    hyper::header::USER_AGENT,
                    concat!("kube-apiserver-proxy/", env!("CARGO_PKG_VERSION")),
                )
                .body(Empty::<Bytes>::new())
                .map_err(|e| get(e.into()))?;
            let answer = http_client::request(stream, req, MAX_BODY)
                .await
                .map_err(get)?;
            Ok(Some((path.as_str(), answer.status)))
        }
    }
}

/// What an https check's answer means.
fn classify_status(path: &str, status: hyper::StatusCode) -> CheckResult {
    if status == hyper::StatusCode::OK {
        CheckResult::ok()
    } else if status.is_client_error() {
        // 4xx: the apiserver refuses the request itself (no access for the check's identity, a
        // wrong path); that is a failing check, not an apiserver saying it is not ready.
        CheckResult::fail(
            Observation::Failed,
            format!("GET {path}: HTTP {status} (check --health-path and the check's credentials)"),
        )
    } else {
        CheckResult::fail(Observation::NotReady, format!("GET {path}: HTTP {status}"))
    }
}

/// What a check that got no answer means: refused, no descriptor here, or failed.
fn classify_error(e: CheckError) -> CheckResult {
    match &e {
        CheckError::Reach(HttpError::Connect { source, .. }) => {
            if source.kind() == io::ErrorKind::ConnectionRefused {
                CheckResult::fail(Observation::Refused, e.to_string())
            } else if crate::base::net::is_local_exhaustion(source) {
                CheckResult::fail(
                    Observation::Skipped,
                    format!("no descriptor here: {source}"),
                )
            } else {
                CheckResult::fail(Observation::Failed, e.to_string())
            }
        }
        _ => CheckResult::fail(Observation::Failed, e.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    const TIMEOUT: Duration = Duration::from_secs(5);
    const CERT: &str = include_str!("../testdata/cert.pem");
    const KEY: &str = include_str!("../testdata/key.pem");

    fn server_tls() -> Arc<rustls::ServerConfig> {
        let certs = rustls_pemfile::certs(&mut CERT.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let key = rustls_pemfile::private_key(&mut KEY.as_bytes())
            .unwrap()
            .unwrap();
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
        Arc::new(config)
    }

    /// An https server on 127.0.0.1 answering every request with `status` (an empty body).
    async fn https_server(status: &'static str) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(server_tls());
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut s) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let mut buf = vec![0u8; 4096];
                    let mut got = Vec::new();
                    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    let answer = format!("HTTP/1.1 {status}\r\ncontent-length: 2\r\n\r\nok");
                    let _ = s.write_all(answer.as_bytes()).await;
                    let _ = s.shutdown().await;
                });
            }
        });
        addr
    }

    fn name() -> rustls::pki_types::ServerName<'static> {
        rustls::pki_types::ServerName::try_from("kubernetes").unwrap()
    }

    /// An https check that trusts any certificate.
    fn https() -> HealthCheck {
        HealthCheck::Https {
            tls: crate::backends::tls::client_config(None, None).unwrap(),
            server_name: name(),
            path: "/readyz".into(),
        }
    }

    /// An address nobody listens on.
    fn closed() -> SocketAddr {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    }

    #[tokio::test]
    async fn https_200_is_ready() {
        let addr = https_server("200 OK").await;
        assert_eq!(check_once(&https(), addr, TIMEOUT).await, CheckResult::ok());
        let tls = HealthCheck::Tls {
            tls: crate::backends::tls::client_config(None, None).unwrap(),
            server_name: name(),
        };
        assert_eq!(check_once(&tls, addr, TIMEOUT).await, CheckResult::ok());
        assert_eq!(
            check_once(&HealthCheck::Tcp, addr, TIMEOUT).await,
            CheckResult::ok()
        );
    }

    #[tokio::test]
    async fn a_5xx_is_not_ready_and_a_4xx_a_failure() {
        let addr = https_server("503 Service Unavailable").await;
        let r = check_once(&https(), addr, TIMEOUT).await;
        assert_eq!(r.obs, Observation::NotReady, "{r:?}");
        let cause = r.cause.unwrap();
        assert!(cause.contains("GET /readyz: HTTP 503"), "{cause}");
        let addr = https_server("403 Forbidden").await;
        let r = check_once(&https(), addr, TIMEOUT).await;
        assert_eq!(r.obs, Observation::Failed, "{r:?}");
        let cause = r.cause.unwrap();
        assert!(
            cause.contains("HTTP 403") && cause.contains("--health-path"),
            "{cause}"
        );
    }

    #[tokio::test]
    async fn a_certificate_that_does_not_verify_fails_the_handshake() {
        // Trusting the server's own certificate: it has no name `kubernetes` (nor any SAN).
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut CERT.as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let check = HealthCheck::Https {
            tls: crate::backends::tls::client_config(Some(roots), None).unwrap(),
            server_name: name(),
            path: "/readyz".into(),
        };
        let addr = https_server("200 OK").await;
        let r = check_once(&check, addr, TIMEOUT).await;
        assert_eq!(r.obs, Observation::Failed, "{r:?}");
        let cause = r.cause.unwrap();
        assert!(cause.starts_with("tls handshake: "), "{cause}");
    }

    #[tokio::test]
    async fn a_refused_connection_is_refused() {
        let addr = closed();
        for check in [https(), HealthCheck::Tcp] {
            let r = check_once(&check, addr, TIMEOUT).await;
            assert_eq!(r.obs, Observation::Refused, "{r:?}");
            let cause = r.cause.unwrap();
            assert!(cause.starts_with(&format!("connect {addr}: ")), "{cause}");
        }
    }

    #[tokio::test]
    async fn no_answer_within_the_timeout_fails() {
        // Connections complete in the backlog; nobody ever answers the TLS hello.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let timeout = Duration::from_millis(200);
        let r = check_once(&https(), addr, timeout).await;
        assert_eq!(r.obs, Observation::Failed, "{r:?}");
        let cause = r.cause.unwrap();
        assert!(cause.contains("no answer within 200ms"), "{cause}");
        drop(silent);
    }
}
