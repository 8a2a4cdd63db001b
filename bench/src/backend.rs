//! Built-in backends, run in a child process (`bench serve-backend`) on a single-threaded tokio
//! runtime so that they neither compete with the load generator's runtime nor hide their CPU:
//!
//! - **echo**: writes back whatever it reads (requests, streams, bulk both ways); a connection
//!   whose first byte is [`CLOSE_AFTER_REPLY`] carries one request (second byte: its total
//!   length), gets it echoed and is then closed by the backend, so that TIME_WAIT lands on the
//!   server side and the load generator does not run out of ephemeral ports under churn;
//! - **sink**: reads and discards;
//! - **stream**: writes zeros as fast as the peer reads;
//! - **echo over TLS** (`echo_tls`): the echo server (one-request protocol included) behind a
//!   TLS handshake. Like kube-apiserver's, its serving certificate is signed by a CA of its own
//!   and names `kubernetes` ([`TLS_SERVER_NAME`]), not the address it is reached on; both are
//!   made by rcgen (ECDSA P-256) when the child starts. TLS runs on the backend's own runtime,
//!   so its cost shows in the backend's CPU figures.
//!
//! All four listen on one random loopback address; the child prints their addresses and the CA
//! certificate (PEM) as one JSON line on stdout ([`BackendHello`]) and serves until killed (or
//! until its stdin closes).

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use kube_apiserver_proxy_tests::certs::Ca;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::procstat::{self, ProcSample};
use kube_apiserver_proxy_tests::util::random_loopback_ip;

/// First byte of a one-request connection (see the module docs).
pub const CLOSE_AFTER_REPLY: u8 = b'C';

/// Buffer size of every backend connection.
const BUFFER: usize = 64 * 1024;

/// The DNS name in the TLS backend's serving certificate, which clients verify (as they verify
/// `kubernetes` against a kube-apiserver reached on an IP address).
pub const TLS_SERVER_NAME: &str = "kubernetes";

/// How long the TLS backend waits for a handshake (a TCP health check never sends one).
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Options of the internal `serve-backend` subcommand.
#[derive(Debug, Clone, Args)]
pub struct ServeBackendArgs {
    /// Address to listen on [default: a random 127.x.y.z].
    #[arg(long)]
    pub ip: Option<IpAddr>,
    /// Serve only the echo backend, on this exact address (shared with other processes by
    /// SO_REUSEPORT), and print `listening` once it listens (the `storm` scenario's restartable
    /// backend).
    #[arg(long, conflicts_with = "ip")]
    pub echo_at: Option<SocketAddr>,
}

/// The addresses of the built-in backends.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct BackendAddrs {
    pub echo: SocketAddr,
    pub sink: SocketAddr,
    pub stream: SocketAddr,
    /// The echo server behind TLS.
    pub echo_tls: SocketAddr,
}

/// The line `serve-backend` prints when its listeners are up.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BackendHello {
    pub addrs: BackendAddrs,
    /// The CA that signed the TLS backend's certificate, PEM.
    pub tls_ca_pem: String,
}

/// The TLS backend's identity: a self-signed CA and a serving certificate it signed.
struct TlsIdentity {
    ca_pem: String,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl TlsIdentity {
    /// Makes a fresh CA and a serving certificate for [`TLS_SERVER_NAME`] (server auth), as
    /// kubeadm does for kube-apiserver.
    fn generate() -> Result<Self> {
        let ca = Ca::new("bench-backend-ca")?;
        let serving = ca.server_cert(&[TLS_SERVER_NAME])?;
        Ok(Self {
            ca_pem: ca.cert_pem(),
            chain: [serving.cert_chain(), vec![ca.cert_der()]].concat(),
            key: serving.private_key(),
        })
    }

    /// The server side. No session tickets: clients do full handshakes (client-go keeps no
    /// session cache), and tickets would only be extra work for the backend.
    fn acceptor(self) -> Result<TlsAcceptor> {
        let mut config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(self.chain, self.key)
            .context("TLS server config")?;
        config.send_tls13_tickets = 0;
        Ok(TlsAcceptor::from(Arc::new(config)))
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The client side of the TLS backend: trusts only `ca_pem`, verifies [`TLS_SERVER_NAME`] and
/// never resumes a session, so every connection makes a full handshake.
#[derive(Clone)]
pub struct TlsClient {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl std::fmt::Debug for TlsClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsClient")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl TlsClient {
    /// A client trusting the CA certificate(s) in `ca_pem`.
    pub fn new(ca_pem: &str) -> Result<Self> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots
                .add(cert.context("parse the backend CA")?)
                .context("trust the backend CA")?;
        }
        anyhow::ensure!(!roots.is_empty(), "no CA certificate from the backend");
        let mut config = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.resumption = rustls::client::Resumption::disabled();
        Ok(Self {
            connector: TlsConnector::from(Arc::new(config)),
            server_name: ServerName::try_from(TLS_SERVER_NAME)?,
        })
    }

    /// Makes the TLS handshake on `stream`.
    pub async fn handshake(
        &self,
        stream: TcpStream,
    ) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
        self.connector
            .connect(self.server_name.clone(), stream)
            .await
    }
}

/// Entry point of `bench serve-backend`.
pub fn serve(args: ServeBackendArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        if let Some(addr) = args.echo_at {
            let listener = bind_shared(addr)?;
            tokio::spawn(accept_loop(listener, Kind::Echo));
            println!("listening");
        } else {
            let ip = match args.ip {
                Some(ip) => ip,
                None => random_loopback_ip()?,
            };
            let hello = listen(ip).await?;
            println!("{}", serde_json::to_string(&hello)?);
        }
        // Exit when the parent goes away (its end of our stdin closes).
        let mut stdin = tokio::io::stdin();
        let mut byte = [0u8; 1];
        while stdin.read(&mut byte).await.unwrap_or(0) > 0 {}
        anyhow::Ok(())
    })
}

/// Binds `addr` for the `storm` scenario's echo backend: with SO_REUSEADDR (as tokio's
/// `TcpListener::bind`), so that a restart rebinds at once whatever the previous instance's
/// connections left in TIME_WAIT, and with SO_REUSEPORT, so that several backend processes
/// share the address (the storm spread over processes). The backlog is `TcpListener::bind`'s
/// (128), per process.
fn bind_shared(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.set_reuseport(true)?;
    socket.bind(addr)?;
    socket.listen(128)
}

/// Binds the four backends on `ip`, spawns their accept loops on the current runtime and
/// returns what to tell the load generator.
pub async fn listen(ip: IpAddr) -> Result<BackendHello> {
    let echo = TcpListener::bind((ip, 0)).await?;
    let sink = TcpListener::bind((ip, 0)).await?;
    let stream = TcpListener::bind((ip, 0)).await?;
    let echo_tls = TcpListener::bind((ip, 0)).await?;
    let identity = TlsIdentity::generate()?;
    let tls_ca_pem = identity.ca_pem.clone();
    let acceptor = identity.acceptor()?;
    let addrs = BackendAddrs {
        echo: echo.local_addr()?,
        sink: sink.local_addr()?,
        stream: stream.local_addr()?,
        echo_tls: echo_tls.local_addr()?,
    };
    tokio::spawn(accept_loop(echo, Kind::Echo));
    tokio::spawn(accept_loop(sink, Kind::Sink));
    tokio::spawn(accept_loop(stream, Kind::Stream));
    tokio::spawn(accept_loop(echo_tls, Kind::EchoTls(acceptor)));
    Ok(BackendHello { addrs, tls_ca_pem })
}

#[derive(Clone)]
enum Kind {
    Echo,
    Sink,
    Stream,
    EchoTls(TlsAcceptor),
}

async fn accept_loop(listener: TcpListener, kind: Kind) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            // EMFILE and friends: back off briefly rather than spin.
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let _ = stream.set_nodelay(true);
        let kind = kind.clone();
        tokio::spawn(async move {
            let _ = match kind {
                Kind::Echo => echo(stream).await,
                Kind::Sink => sink(stream).await,
                Kind::Stream => produce(stream).await,
                Kind::EchoTls(acceptor) => {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => echo(tls).await,
                        _ => Ok(()),
                    }
                }
            };
        });
    }
}

/// Echoes `stream` (plain TCP or TLS); see the module docs for the one-request protocol.
async fn echo<S: AsyncRead + AsyncWrite + Unpin>(mut stream: S) -> std::io::Result<()> {
    let mut buf = vec![0u8; BUFFER];
    let mut n = stream.read(&mut buf).await?;
    if n >= 2 && buf[0] == CLOSE_AFTER_REPLY {
        let want = usize::from(buf[1]).max(2);
        while n < want {
            match stream.read(&mut buf[n..want]).await? {
                0 => return Ok(()),
                more => n += more,
            }
        }
        stream.write_all(&buf[..want]).await?;
        // For TLS, `shutdown` also sends close_notify before the FIN.
        return stream.shutdown().await;
    }
    loop {
        if n == 0 {
            return stream.shutdown().await;
        }
        stream.write_all(&buf[..n]).await?;
        // A no-op for TCP; TLS may hold records back when the socket is full.
        stream.flush().await?;
        n = stream.read(&mut buf).await?;
    }
}

async fn sink(mut stream: TcpStream) -> std::io::Result<()> {
    let mut buf = vec![0u8; BUFFER];
    while stream.read(&mut buf).await? > 0 {}
    Ok(())
}

async fn produce(mut stream: TcpStream) -> std::io::Result<()> {
    let buf = vec![0u8; BUFFER];
    loop {
        stream.write_all(&buf).await?;
    }
}

/// The backend child process, killed on drop.
#[derive(Debug)]
pub struct BackendProcess {
    child: Child,
    addrs: BackendAddrs,
    tls: TlsClient,
}

impl BackendProcess {
    /// Starts `serve-backend` from this very binary and waits for its addresses.
    pub fn start() -> Result<Self> {
        let exe = std::env::current_exe().context("cannot find the bench binary")?;
        let mut child = Command::new(&exe)
            .arg("serve-backend")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("cannot start {} serve-backend", exe.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("cannot read backend addresses")?;
        let hello: BackendHello = serde_json::from_str(&line)
            .with_context(|| format!("backend printed {line:?} instead of its addresses"))?;
        let tls = TlsClient::new(&hello.tls_ca_pem)?;
        Ok(Self {
            child,
            addrs: hello.addrs,
            tls,
        })
    }

    /// Where the backends listen.
    pub fn addrs(&self) -> BackendAddrs {
        self.addrs
    }

    /// A TLS client that trusts the TLS backend (`addrs().echo_tls`).
    pub fn tls_client(&self) -> TlsClient {
        self.tls.clone()
    }

    /// CPU and memory of the backend process.
    pub fn sample(&self) -> Result<ProcSample> {
        procstat::sample(self.child.id())
    }
}

impl Drop for BackendProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::client::{churn_request, connect, exchange, handshake};

    #[tokio::test]
    async fn tls_echo_verifies_and_echoes() -> Result<()> {
        let hello = listen(random_loopback_ip()?).await?;
        let tls = TlsClient::new(&hello.tls_ca_pem)?;
        let timeout = Duration::from_secs(5);

        // One-request protocol: full handshake, echo, backend closes.
        churn_request(hello.addrs.echo_tls, 16, timeout, Some(&tls))
            .await
            .map_err(|kind| anyhow::anyhow!("TLS churn request failed: {kind:?}"))?;

        // Persistent echo, several exchanges on one connection.
        let stream = connect(hello.addrs.echo_tls, timeout)
            .await
            .map_err(|kind| anyhow::anyhow!("connect: {kind:?}"))?;
        let mut stream = handshake(&tls, stream, timeout)
            .await
            .map_err(|kind| anyhow::anyhow!("handshake: {kind:?}"))?;
        for i in 0..3u8 {
            let request = [i; 64];
            let mut answer = [0u8; 64];
            exchange(&mut stream, &request, &mut answer, timeout)
                .await
                .map_err(|kind| anyhow::anyhow!("exchange: {kind:?}"))?;
            assert_eq!(answer, request);
        }

        // A client that trusts another CA refuses the backend.
        let other = TlsIdentity::generate()?;
        let stranger = TlsClient::new(&other.ca_pem)?;
        assert!(
            churn_request(hello.addrs.echo_tls, 16, timeout, Some(&stranger))
                .await
                .is_err()
        );
        Ok(())
    }
}
