//! `kube-apiserver-proxy probe`: an HTTP GET for exec probes (the images have no curl).
//!
//! Exit 0 when the URL answers 200, 1 otherwise.

use std::time::Duration;

use http_body_util::Empty;
use hyper::body::Bytes;
use hyper_util::rt::TokioIo;

use crate::cli::ProbeArgs;

/// Why a probe failed.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("{0}: not an http://host:port/path URL")]
    BadUrl(String),
    #[error("cannot read admin address file {path}: {source}")]
    AddressFile {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{url}: {message}")]
    Failed { url: String, message: String },
}

/// The URL a probe targets.
pub fn target(args: &ProbeArgs) -> Result<String, ProbeError> {
    if let Some(url) = &args.url {
        return Ok(url.clone());
    }
    let path = args
        .admin_address_file
        .as_ref()
        .expect("clap requires url or file");
    let addr = std::fs::read_to_string(path).map_err(|source| ProbeError::AddressFile {
        path: path.display().to_string(),
        source,
    })?;
    Ok(format!("http://{}{}", addr.trim(), args.path))
}

/// GETs `url`; `Ok` when it answered 200.
pub async fn probe(url: &str, timeout: Duration) -> Result<(), ProbeError> {
    let uri: hyper::Uri = url
        .parse()
        .map_err(|_| ProbeError::BadUrl(url.to_string()))?;
    if uri.scheme_str() != Some("http") {
        return Err(ProbeError::BadUrl(url.to_string()));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| ProbeError::BadUrl(url.to_string()))?
        .clone();
    let failed = |message: String| ProbeError::Failed {
        url: url.to_string(),
        message,
    };
    let work = async {
        let stream = tokio::net::TcpStream::connect(authority.as_str())
            .await
            .map_err(|e| failed(e.to_string()))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
                .await
                .map_err(|e| failed(e.to_string()))?;
        tokio::spawn(conn);
        let req = hyper::Request::get(uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
            .header(hyper::header::HOST, authority.as_str())
            .body(Empty::new())
            .map_err(|e| failed(e.to_string()))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| failed(e.to_string()))?;
        if resp.status() == hyper::StatusCode::OK {
            Ok(())
        } else {
            Err(failed(format!("HTTP {}", resp.status())))
        }
    };
    tokio::time::timeout(timeout, work)
        .await
        .unwrap_or_else(|_| Err(failed(format!("no answer within {timeout:?}"))))
}
