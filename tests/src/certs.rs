//! Test PKI made with rcgen (ring): a CA, a kube-apiserver serving certificate and client
//! certificates signed by it, as rustls types and as PEM files.
//!
//! Like a real kube-apiserver's, the serving certificate names `kubernetes` (and `localhost`)
//! but none of the random loopback addresses it is reached on, so clients verify the name
//! `kubernetes` (the proxy's `--health-server-name` default).
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! let pki = kube_apiserver_proxy_tests::certs::Pki::new()?;
//! let ca_file = pki.ca_file(); // for --health-ca-file
//! # Ok(()) }
//! ```

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context as _, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use rustls::RootCertStore;

use crate::util::TempDir;

/// The names in the default serving certificate.
pub const SERVING_NAMES: &[&str] = &["kubernetes", "kubernetes.default", "localhost"];

/// The TLS server name tests use to reach the (fake) apiserver.
pub const SERVER_NAME: &str = "kubernetes";

/// A certificate authority that signs serving and client certificates.
pub struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    /// Creates a self-signed CA named `common_name`.
    pub fn new(common_name: &str) -> Result<Self> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = name(common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().context("generate CA key")?;
        let cert = params.self_signed(&key).context("self-sign CA")?;
        Ok(Self { cert, key })
    }

    /// The CA certificate, PEM.
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// The CA certificate, DER.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert.der().clone()
    }

    /// A root store trusting only this CA.
    pub fn root_store(&self) -> Result<RootCertStore> {
        let mut roots = RootCertStore::empty();
        roots.add(self.cert_der()).context("add CA to root store")?;
        Ok(roots)
    }

    /// Issues a serving certificate for the DNS `names` (server auth).
    pub fn server_cert(&self, names: &[&str]) -> Result<CertifiedKey> {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names.clone())?;
        params.distinguished_name = name(names.first().map_or("server", String::as_str));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        self.issue(params)
    }

    /// Issues the kube-apiserver serving certificate ([`SERVING_NAMES`]).
    pub fn serving_cert(&self) -> Result<CertifiedKey> {
        self.server_cert(SERVING_NAMES)
    }

    /// Issues a client certificate with common name `common_name` (client auth).
    pub fn client_cert(&self, common_name: &str) -> Result<CertifiedKey> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.distinguished_name = name(common_name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        self.issue(params)
    }

    fn issue(&self, params: CertificateParams) -> Result<CertifiedKey> {
        let key = KeyPair::generate().context("generate key")?;
        let cert = params
            .signed_by(&key, &self.cert, &self.key)
            .context("sign certificate")?;
        Ok(CertifiedKey {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().clone(),
            key_der: key.serialize_der(),
        })
    }
}

fn name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn
}

/// A leaf certificate with its private key.
#[derive(Clone)]
pub struct CertifiedKey {
    /// The certificate, PEM.
    pub cert_pem: String,
    /// The PKCS#8 private key, PEM.
    pub key_pem: String,
    cert_der: CertificateDer<'static>,
    key_der: Vec<u8>,
}

impl CertifiedKey {
    /// The certificate chain for rustls (the leaf only; the peer trusts the CA).
    pub fn cert_chain(&self) -> Vec<CertificateDer<'static>> {
        vec![self.cert_der.clone()]
    }

    /// The private key for rustls.
    pub fn private_key(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }

    /// Writes `dir/<stem>.crt` and `dir/<stem>.key`; returns their paths.
    pub fn write_pem(&self, dir: &Path, stem: &str) -> Result<(PathBuf, PathBuf)> {
        let cert = dir.join(format!("{stem}.crt"));
        let key = dir.join(format!("{stem}.key"));
        std::fs::write(&cert, &self.cert_pem)
            .with_context(|| format!("write {}", cert.display()))?;
        std::fs::write(&key, &self.key_pem).with_context(|| format!("write {}", key.display()))?;
        Ok((cert, key))
    }
}

/// A complete test PKI: CA, serving certificate, one client certificate, all also written as
/// PEM files into a temporary directory (removed when the `Pki` is dropped).
pub struct Pki {
    /// The CA that signed everything below.
    pub ca: Ca,
    /// The apiserver serving certificate ([`SERVING_NAMES`]).
    pub server: CertifiedKey,
    /// A client certificate (`CN=kube-apiserver-proxy-health`).
    pub client: CertifiedKey,
    dir: TempDir,
}

impl Pki {
    /// Generates a fresh PKI and writes `ca.crt`, `server.{crt,key}`, `client.{crt,key}`.
    pub fn new() -> Result<Self> {
        let ca = Ca::new("kube-apiserver-proxy-tests-ca")?;
        let server = ca.serving_cert()?;
        let client = ca.client_cert("kube-apiserver-proxy-health")?;
        let dir = TempDir::new("pki")?;
        std::fs::write(dir.join("ca.crt"), ca.cert_pem()).context("write ca.crt")?;
        server.write_pem(dir.path(), "server")?;
        client.write_pem(dir.path(), "client")?;
        Ok(Self {
            ca,
            server,
            client,
            dir,
        })
    }

    /// The directory holding the PEM files.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// CA certificate file (`--health-ca-file`).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// Serving certificate file.
    pub fn server_cert_file(&self) -> PathBuf {
        self.dir.join("server.crt")
    }

    /// Serving key file.
    pub fn server_key_file(&self) -> PathBuf {
        self.dir.join("server.key")
    }

    /// Client certificate file (`--health-client-cert`).
    pub fn client_cert_file(&self) -> PathBuf {
        self.dir.join("client.crt")
    }

    /// Client key file (`--health-client-key`).
    pub fn client_key_file(&self) -> PathBuf {
        self.dir.join("client.key")
    }

    /// `--metrics-tls-cert-file`, `--metrics-tls-key-file` (the serving pair) and
    /// `--metrics-client-ca-file` (this CA): a scrape address that speaks TLS and asks for a
    /// client certificate of this PKI.
    pub fn metrics_tls_flags(&self) -> [String; 3] {
        [
            format!(
                "--metrics-tls-cert-file={}",
                self.server_cert_file().display()
            ),
            format!(
                "--metrics-tls-key-file={}",
                self.server_key_file().display()
            ),
            format!("--metrics-client-ca-file={}", self.ca_file().display()),
        ]
    }

    /// A rustls client config trusting this CA, presenting the client certificate if
    /// `with_client_cert`.
    pub fn client_config(&self, with_client_cert: bool) -> Result<Arc<rustls::ClientConfig>> {
        let builder =
            rustls::ClientConfig::builder_with_provider(crate::fake_apiserver::crypto_provider())
                .with_safe_default_protocol_versions()?
                .with_root_certificates(self.ca.root_store()?);
        let config = if with_client_cert {
            builder.with_client_auth_cert(self.client.cert_chain(), self.client.private_key())?
        } else {
            builder.with_no_client_auth()
        };
        Ok(Arc::new(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pki_files_parse_as_pem() {
        let pki = Pki::new().unwrap();
        let ca = std::fs::read(pki.ca_file()).unwrap();
        let certs: Vec<_> = rustls_pemfile::certs(&mut ca.as_slice())
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(certs.len(), 1);
        let key = std::fs::read(pki.client_key_file()).unwrap();
        assert!(rustls_pemfile::private_key(&mut key.as_slice())
            .unwrap()
            .is_some());
        let dir = pki.dir().to_owned();
        drop(pki);
        assert!(!dir.exists());
    }

    #[test]
    fn client_config_builds_with_and_without_cert() {
        let pki = Pki::new().unwrap();
        pki.client_config(true).unwrap();
        pki.client_config(false).unwrap();
    }
}
