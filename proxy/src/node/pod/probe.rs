//! `kube-apiserver-proxy probe`: an HTTP(S) GET for exec probes (the images have no curl).
//!
//! Exit 0 when the URL answers 200, 1 otherwise. Plain HTTP serves the proxy's own admin
//! endpoint (`--admin-address-file`); HTTPS serves the apiserver on its random loopback address
//! (`--address-file` written by `launch`), verified against the cluster CA with the server name
//! `kubernetes` (the serving certificate has no SAN for 127.a.b.c).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;

use crate::backends::tls;
use crate::base::exit::CommandError;
use crate::base::http_client::{self, HttpError};

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{0}: not an http(s)://host:port/path URL")]
    BadUrl(String),
    #[error("cannot read address file {path}: {source}")]
    AddressFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("https needs --ca-file or --insecure-skip-verify")]
    NoTrust,
    #[error("{flag} {path}: {source}")]
    Tls {
        flag: &'static str,
        path: String,
        #[source]
        source: tls::TlsError,
    },
    #[error("{url}: TLS: {source}")]
    Handshake {
        url: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{url}: {source}")]
    Failed {
        url: String,
        #[source]
        source: HttpError,
    },
}

impl crate::base::exit::CommandError for ProbeError {
    /// Bad flags or files (exit 2) rather than a failed probe (exit 1).
    fn is_bad_input(&self) -> bool {
        matches!(
            self,
            ProbeError::NoTrust | ProbeError::Tls { .. } | ProbeError::BadUrl(_)
        )
    }
}

impl ProbeError {
    /// Nothing listens at the target: its address file is missing, or the connection was
    /// refused (a timeout is not: something may hang there).
    pub fn nothing_listens(&self) -> bool {
        match self {
            ProbeError::AddressFile { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
            ProbeError::Failed {
                source: HttpError::Connect { source, .. },
                ..
            } => source.kind() == std::io::ErrorKind::ConnectionRefused,
            _ => false,
        }
    }
}

/// Time between attempts of `probe --wait`.
pub const WAIT_RETRY: Duration = Duration::from_secs(1);

/// What `probe` is asked for (its flags, `cli::ProbeArgs`).
#[derive(Debug, Clone)]
pub struct Options {
    /// URL to GET: http://IP:PORT/PATH, or https://IP:PORT/PATH (with --ca-file or
    /// --insecure-skip-verify).
    pub url: Option<String>,

    /// Read the admin address from this file (written by `run --admin-address-file`); plain HTTP.
    pub admin_address_file: Option<PathBuf>,

    /// Read an apiserver address from this file (written by `launch --address-file`); HTTPS.
    pub address_file: Option<PathBuf>,

    /// Path to probe when the address comes from a file.
    pub path: String,

    /// HTTPS: PEM CA bundle that verifies the server certificate.
    pub ca_file: Option<PathBuf>,

    /// HTTPS: server name sent (SNI) and verified.
    pub server_name: String,

    /// HTTPS: do not verify the server certificate.
    pub insecure_skip_verify: bool,

    /// HTTPS: client certificate (PEM), with --client-key.
    pub client_cert: Option<PathBuf>,

    /// HTTPS: private key of --client-cert (PEM).
    pub client_key: Option<PathBuf>,

    /// Time the probe may take.
    pub timeout: Duration,

    /// Try again every second until the probe passes or this much time has passed (0, the default: once). For preStop hooks that wait for a condition.
    pub wait: Duration,

    /// Pass at once when nothing listens at the address: its file is missing or the connection
    /// is refused. For the preStop hooks that keep this pod serving until a peer is ready: when
    /// this pod's proxy does not run, there is nothing to keep serving (a proxy that cannot
    /// start must not hold its pod's deletion for the whole wait).
    pub pass_when_down: bool,
}

/// Runs the probe the flags describe, on a small runtime of its own; with `--wait`, again
/// every [`WAIT_RETRY`] until it passes or the wait is over (the address file is read anew
/// each time: the instance behind it may have restarted).
pub fn run(args: &Options) -> Result<(), ProbeError> {
    let runtime = crate::base::runtime::current_thread().expect("tokio runtime");
    let deadline = std::time::Instant::now() + args.wait;
    runtime.block_on(async {
        loop {
            let result = match target(args) {
                Ok(target) => probe(&target, args.timeout).await,
                Err(e) => Err(e),
            };
            match result {
                Err(e) if args.pass_when_down && e.nothing_listens() => {
                    eprintln!("probe: nothing listens ({e}): passing (--pass-when-down)");
                    return Ok(());
                }
                Err(e) if !e.is_bad_input() && std::time::Instant::now() < deadline => {
                    tokio::time::sleep(WAIT_RETRY).await;
                }
                other => return other,
            }
        }
    })
}

/// A probe target: the URL and, for https, the TLS settings.
pub struct Target {
    pub url: String,
    tls: Option<(
        Arc<rustls::ClientConfig>,
        rustls::pki_types::ServerName<'static>,
    )>,
}

fn read_address(path: &Path) -> Result<String, ProbeError> {
    let text = std::fs::read_to_string(path).map_err(|source| ProbeError::AddressFile {
        path: path.display().to_string(),
        source,
    })?;
    Ok(text.trim().to_string())
}

/// The target a probe's flags describe.
pub fn target(args: &Options) -> Result<Target, ProbeError> {
    let url = if let Some(url) = &args.url {
        url.clone()
    } else if let Some(file) = &args.admin_address_file {
        format!("http://{}{}", read_address(file)?, args.path)
    } else {
        let file = args.address_file.as_ref().expect("clap requires a target");
        format!("https://{}{}", read_address(file)?, args.path)
    };
    if !url.starts_with("https://") {
        return Ok(Target { url, tls: None });
    }
    let tls_err = |flag: &'static str, path: &Path| {
        let path = path.display().to_string();
        move |source| ProbeError::Tls { flag, path, source }
    };
    let roots = match (&args.ca_file, args.insecure_skip_verify) {
        (Some(ca), _) => Some(tls::load_roots(ca).map_err(tls_err("--ca-file", ca))?),
        (None, true) => None,
        (None, false) => return Err(ProbeError::NoTrust),
    };
    let client = match (&args.client_cert, &args.client_key) {
        (Some(cert), Some(key)) => Some((
            tls::load_certs(cert).map_err(tls_err("--client-cert", cert))?,
            tls::load_key(key).map_err(tls_err("--client-key", key))?,
        )),
        _ => None,
    };
    let config = tls::client_config(roots, client).map_err(|source| ProbeError::Tls {
        flag: "--client-key",
        path: String::new(),
        source,
    })?;
    let name = rustls::pki_types::ServerName::try_from(args.server_name.clone())
        .map_err(|_| ProbeError::BadUrl(format!("--server-name {}", args.server_name)))?;
    Ok(Target {
        url,
        tls: Some((config, name)),
    })
}

/// Largest answer a probe reads.
const MAX_BODY: usize = 1 << 20;

/// GETs the target; `Ok` when it answered 200.
pub async fn probe(target: &Target, timeout: Duration) -> Result<(), ProbeError> {
    let url = target.url.as_str();
    let bad_url = || ProbeError::BadUrl(url.to_string());
    let uri: hyper::Uri = url.parse().map_err(|_| bad_url())?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(bad_url()),
    };
    let authority = uri.authority().ok_or_else(bad_url)?.clone();
    let tls = match (&target.tls, https) {
        (Some(tls), true) => Some(tls),
        (None, false) => None,
        _ => return Err(ProbeError::NoTrust),
    };
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, authority.as_str())
        .body(Empty::<Bytes>::new());
    let work = async {
        let req = req?;
        let tcp = http_client::connect(http_client::resolve(host, port).await?).await?;
        let answer = match tls {
            Some((config, name)) => {
                let stream = http_client::tls(config.clone(), name.clone(), tcp).await?;
                http_client::request(stream, req, MAX_BODY).await?
            }
            None => http_client::request(tcp, req, MAX_BODY).await?,
        };
        answer.accept(|s| s == hyper::StatusCode::OK, 0)
    };
    http_client::within(timeout, work)
        .await
        .map(drop)
        .map_err(|e| match e {
            HttpError::Tls(source) => ProbeError::Handshake {
                url: url.to_string(),
                source,
            },
            source => ProbeError::Failed {
                url: url.to_string(),
                source,
            },
        })
}
