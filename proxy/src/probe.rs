//! `kube-apiserver-proxy probe`: an HTTP(S) GET for exec probes (the images have no curl).
//!
//! Exit 0 when the URL answers 200, 1 otherwise. Plain HTTP serves the proxy's own admin
//! endpoint (`--admin-address-file`); HTTPS serves the apiserver on its random loopback address
//! (`--address-file` written by `launch`), verified against the cluster CA with the server name
//! `kubernetes` (the serving certificate has no SAN for 127.a.b.c).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

use crate::cli::ProbeArgs;
use crate::tls;

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
    #[error("{url}: {message}")]
    Failed { url: String, message: String },
}

impl ProbeError {
    /// Bad flags or files (exit 2) rather than a failed probe (exit 1).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            ProbeError::NoTrust | ProbeError::Tls { .. } | ProbeError::BadUrl(_)
        )
    }
}

/// Time between attempts of `probe --wait`.
pub const WAIT_RETRY: Duration = Duration::from_secs(1);

/// Runs the probe the flags describe, on a small runtime of its own; with `--wait`, again
/// every [`WAIT_RETRY`] until it passes or the wait is over (the address file is read anew
/// each time: the instance behind it may have restarted).
pub fn run(args: &ProbeArgs) -> Result<(), ProbeError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let deadline = std::time::Instant::now() + args.wait;
    runtime.block_on(async {
        loop {
            let result = match target(args) {
                Ok(target) => probe(&target, args.timeout).await,
                Err(e) => Err(e),
            };
            match result {
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
pub fn target(args: &ProbeArgs) -> Result<Target, ProbeError> {
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

/// GETs the target; `Ok` when it answered 200.
pub async fn probe(target: &Target, timeout: Duration) -> Result<(), ProbeError> {
    let url = target.url.as_str();
    let uri: hyper::Uri = url
        .parse()
        .map_err(|_| ProbeError::BadUrl(url.to_string()))?;
    let https = match uri.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => return Err(ProbeError::BadUrl(url.to_string())),
    };
    let authority = uri
        .authority()
        .ok_or_else(|| ProbeError::BadUrl(url.to_string()))?
        .clone();
    let failed = |message: String| ProbeError::Failed {
        url: url.to_string(),
        message,
    };
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let work = async {
        let tcp = tokio::net::TcpStream::connect(authority.as_str())
            .await
            .map_err(|e| failed(e.to_string()))?;
        match (&target.tls, https) {
            (Some((config, name)), true) => {
                let stream = tokio_rustls::TlsConnector::from(config.clone())
                    .connect(name.clone(), tcp)
                    .await
                    .map_err(|e| failed(format!("TLS: {e}")))?;
                get(stream, authority.as_str(), path).await.map_err(failed)
            }
            (None, false) => get(tcp, authority.as_str(), path).await.map_err(failed),
            _ => Err(ProbeError::NoTrust),
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(failed(format!("no answer within {timeout:?}"))))
}

async fn get<S>(stream: S, host: &str, path: &str) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::get(path)
        .header(hyper::header::HOST, host)
        .body(Empty::new())
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    if resp.status() == hyper::StatusCode::OK {
        Ok(())
    } else {
        Err(format!("HTTP {}", resp.status()))
    }
}
