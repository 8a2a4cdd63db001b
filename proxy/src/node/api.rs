//! The node agents' one Kubernetes API client: an apiserver, the credentials of a kubeconfig
//! (client certificate or bearer token), a client certificate alone (etcd's JSON gateway, for
//! the canary) or none (anonymous reads of `/readyz` and `/version`); requests and answers are
//! Kubernetes objects of [`crate::node::object`] (those written back read with nothing lost)
//! or other JSON, with a typed error. `recover`, `kubeadm-sync` (and its identity, canary and
//! lease handover), `migrate` and `migrate-back` all speak through it.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{Empty, Full};
use hyper::body::Bytes;
use hyper::StatusCode;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::base::http_client::{self, HttpError};
use crate::node::kubeconfig::{self, KubeconfigError, Problem};
use crate::node::object::{self, ObjectError};

/// Time one API request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Largest answer accepted from the API.
const MAX_BODY: usize = 16 << 20;

/// Why an API request failed: no answer, an answer of another status, not JSON, or not the
/// object asked for.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("not JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error(transparent)]
    Object(#[from] ObjectError),
}

impl ApiError {
    /// The status of an answer refused for it.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            ApiError::Http(HttpError::Status { status, .. }) => Some(*status),
            _ => None,
        }
    }
}

/// Why an anonymous client cannot be made.
#[derive(Debug, thiserror::Error)]
pub enum AnonymousError {
    #[error("{0}")]
    Tls(#[from] crate::backends::tls::TlsError),
    #[error("server name {name}: {source}")]
    ServerName {
        name: String,
        #[source]
        source: rustls::pki_types::InvalidDnsNameError,
    },
}

/// An apiserver and the credentials to read from it.
#[derive(Clone)]
pub struct ApiClient {
    host: String,
    port: u16,
    server_name: rustls::pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    /// Sent as `Authorization: Bearer`.
    token: Option<String>,
}

impl std::fmt::Debug for ApiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "https://{}", self.authority())
    }
}

impl ApiClient {
    /// From a kubeconfig (as kubeadm writes `kubelet.conf`, or any other): its current
    /// context's server, CA and client certificate and key or token ([`crate::node::kubeconfig`]).
    pub fn from_kubeconfig(path: &Path) -> Result<Self, KubeconfigError> {
        Self::from_config(kubeconfig::read(path)?, path)
    }

    /// From a kubeconfig already read from `path` (named in errors).
    pub fn from_config(k: kubeconfig::Kubeconfig, path: &Path) -> Result<Self, KubeconfigError> {
        Self::from_current_context(k).map_err(|problem| KubeconfigError {
            path: path.display().to_string(),
            problem,
        })
    }

    fn from_current_context(k: kubeconfig::Kubeconfig) -> Result<Self, Problem> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut &k.ca[..]) {
            let cert = cert.map_err(|source| Problem::Pem {
                key: "certificate-authority",
                source,
            })?;
            roots.add(cert).map_err(Problem::Root)?;
        }
        let client = match &k.client {
            Some((cert, key)) => {
                let certs = rustls_pemfile::certs(&mut &cert[..])
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|source| Problem::Pem {
                        key: "client-certificate",
                        source,
                    })?;
                let key = rustls_pemfile::private_key(&mut &key[..])
                    .map_err(|source| Problem::Pem {
                        key: "client-key",
                        source,
                    })?
                    .ok_or(Problem::NoPemKey("client-key"))?;
                Some((certs, key))
            }
            None => None,
        };
        let tls = crate::backends::tls::client_config(Some(roots), client).map_err(Problem::Tls)?;
        let server_name =
            rustls::pki_types::ServerName::try_from(k.host.clone()).map_err(|source| {
                Problem::ServerName {
                    server: k.server.clone(),
                    source,
                }
            })?;
        Ok(ApiClient {
            host: k.host,
            port: k.port,
            server_name,
            tls,
            token: k.token,
        })
    }

    /// A server at `host:port` that asks for a client certificate (etcd's client port, its JSON
    /// gateway): verified against the PEM CA bundle `ca`, as the PEM certificate `cert` with its
    /// key `key`.
    pub fn mutual(
        host: &str,
        port: u16,
        ca: Vec<u8>,
        cert: Vec<u8>,
        key: Vec<u8>,
    ) -> Result<Self, Problem> {
        Self::from_current_context(kubeconfig::Kubeconfig {
            host: host.to_owned(),
            port,
            server: format!("https://{host}:{port}"),
            ca,
            client: Some((cert, key)),
            token: None,
        })
    }

    /// An apiserver at `addr` verified against the CA bundle `ca` under `server_name`, read
    /// anonymously (`/readyz`, `/version`).
    pub fn anonymous(
        addr: SocketAddr,
        ca: &Path,
        server_name: &str,
    ) -> Result<Self, AnonymousError> {
        let roots = crate::backends::tls::load_roots(ca)?;
        let tls = crate::backends::tls::client_config(Some(roots), None)?;
        Ok(ApiClient {
            host: addr.ip().to_string(),
            port: addr.port(),
            server_name: rustls::pki_types::ServerName::try_from(server_name.to_owned()).map_err(
                |source| AnonymousError::ServerName {
                    name: server_name.to_owned(),
                    source,
                },
            )?,
            tls,
            token: None,
        })
    }

    /// `host:port`, an IPv6 host in brackets.
    fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// `GET path` (with query); the JSON body of a 200 as a `T`: an object only looked at
    /// ([`object::inspect`]: fields `T` does not have are left out), a list, an answer that is
    /// not a Kubernetes object.
    pub async fn get_as<T: DeserializeOwned>(&self, path: &str) -> Result<T, ApiError> {
        let body = self.get(path).await?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// `GET path`: the Kubernetes object `K` of a 200 ([`object::from_value`]: refused when a
    /// field of it would be lost).
    pub async fn get_object<K>(&self, path: &str) -> Result<K, ApiError>
    where
        K: k8s_openapi::Resource + DeserializeOwned + Serialize,
    {
        Ok(object::from_value(self.get_as(path).await?)?)
    }

    /// `METHOD path` with the object `object` (`PUT`, `POST`); the object `K` of a 2xx.
    pub async fn send_object<K>(&self, method: &str, path: &str, object: &K) -> Result<K, ApiError>
    where
        K: k8s_openapi::Resource + DeserializeOwned + Serialize,
    {
        let answer = self
            .send_json(method, path, &object::to_value(object))
            .await?;
        Ok(object::from_value(answer)?)
    }

    /// `GET path` (with query); the body of a 200.
    pub async fn get(&self, path: &str) -> Result<Bytes, ApiError> {
        let req = hyper::Request::get(path).header(
            hyper::header::USER_AGENT,
            concat!("kube-apiserver-proxy-recover/", env!("CARGO_PKG_VERSION")),
        );
        let answer = self.call(req, Empty::<Bytes>::new()).await?;
        Ok(answer.accept(|s| s == StatusCode::OK, 200)?)
    }

    /// `METHOD path` with a JSON body (`PUT`, `POST`); the JSON answer of a 2xx.
    pub async fn send_json(
        &self,
        method: &str,
        path: &str,
        body: &Value,
    ) -> Result<Value, ApiError> {
        let body = Bytes::from(serde_json::to_vec(body).expect("a JSON body serializes"));
        let req = hyper::Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(
                hyper::header::USER_AGENT,
                concat!("kube-apiserver-proxy/", env!("CARGO_PKG_VERSION")),
            );
        let answer = self.call(req, Full::new(body)).await?;
        let body = answer.accept(|s| s.is_success(), 300)?;
        Ok(serde_json::from_slice(&body)?)
    }

    /// Sends `req` with `body` (and `Host`, `Accept`, the token) over a new connection, within
    /// [`REQUEST_TIMEOUT`].
    async fn call<B>(
        &self,
        req: hyper::http::request::Builder,
        body: B,
    ) -> Result<http_client::Answer, HttpError>
    where
        B: hyper::body::Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let mut req = req
            .header(hyper::header::HOST, self.authority())
            .header(hyper::header::ACCEPT, "application/json");
        if let Some(token) = &self.token {
            req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = req.body(body)?;
        http_client::within(REQUEST_TIMEOUT, async {
            let addr = http_client::resolve(&self.host, self.port).await?;
            let tcp = http_client::connect(addr).await?;
            let tls = http_client::tls(self.tls.clone(), self.server_name.clone(), tcp).await?;
            http_client::request(tls, req, MAX_BODY).await
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use base64::Engine as _;

    #[test]
    fn kubeconfig_inline_and_file_material() {
        let dir = std::env::temp_dir().join(format!("kap-kubeconfig-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = rcgen_free_pem();
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let inline = format!(
            "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority-data: {}\n    server: https://192.0.2.10:6443\n  name: c\nusers:\n- name: u\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n",
            b64(&ca.0), b64(&ca.0), b64(&ca.1)
        );
        std::fs::write(dir.join("inline.conf"), inline).unwrap();
        let c = ApiClient::from_kubeconfig(&dir.join("inline.conf")).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("192.0.2.10", 6443));
        std::fs::write(dir.join("ca.crt"), &ca.0).unwrap();
        std::fs::write(dir.join("client.pem"), format!("{}{}", ca.0, ca.1)).unwrap();
        let files = "clusters:\n- cluster:\n    certificate-authority: ca.crt\n    server: \"https://cp.example:7443\"\nusers:\n- user:\n    client-certificate: client.pem\n    client-key: client.pem\n";
        std::fs::write(dir.join("files.conf"), files).unwrap();
        let c = ApiClient::from_kubeconfig(&dir.join("files.conf")).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("cp.example", 7443));
        std::fs::write(dir.join("bad.conf"), "clusters: []\n").unwrap();
        let e = ApiClient::from_kubeconfig(&dir.join("bad.conf")).unwrap_err();
        assert!(e.to_string().contains("no server"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn kubeconfig_current_context_with_a_token_user() {
        let dir = std::env::temp_dir().join(format!("kap-kubeconfig-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = rcgen_free_pem();
        std::fs::write(dir.join("ca.crt"), &cert).unwrap();
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let text = format!(
            "clusters:\n- name: old\n  cluster:\n    server: https://192.0.2.1:6443\n    certificate-authority: missing.crt\n- name: new\n  cluster:\n    server: https://[2001:db8::5]:8443\n    certificate-authority: ca.crt\ncontexts:\n- name: old\n  context: {{cluster: old, user: cert}}\n- name: new\n  context: {{cluster: new, user: token}}\ncurrent-context: new\nusers:\n- name: cert\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\n- name: token\n  user:\n    token: abc\n",
            b64(&cert),
            b64(&key)
        );
        std::fs::write(dir.join("k.conf"), &text).unwrap();
        let c = ApiClient::from_kubeconfig(&dir.join("k.conf")).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("2001:db8::5", 8443));
        assert_eq!(c.authority(), "[2001:db8::5]:8443");
        assert_eq!(c.token.as_deref(), Some("abc"));
        // The other context's CA file is missing: it is named when that context is current.
        std::fs::write(
            dir.join("k.conf"),
            text.replace("current-context: new", "current-context: old"),
        )
        .unwrap();
        let e = ApiClient::from_kubeconfig(&dir.join("k.conf"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("k.conf: certificate-authority missing.crt: "),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A self-signed certificate and its key, PEM (a fixed test vector).
    fn rcgen_free_pem() -> (String, String) {
        (TEST_CERT.to_owned(), TEST_KEY.to_owned())
    }

    const TEST_CERT: &str = include_str!("../testdata/cert.pem");
    const TEST_KEY: &str = include_str!("../testdata/key.pem");
}
