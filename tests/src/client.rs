//! Test clients: plain HTTP (the proxy's admin endpoint), HTTPS to a (fake) apiserver through
//! any TCP address with server name `kubernetes`, long-lived watch streams and raw TCP.
//!
//! Every network wait is bounded ([`IO_TIMEOUT`] unless a deadline is passed) so that a
//! misbehaving proxy fails a test instead of hanging it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Bytes, Incoming};
use hyper::client::conn::http1::SendRequest;
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::certs::SERVER_NAME;

/// Upper bound of any single network operation in the clients.
pub const IO_TIMEOUT: Duration = Duration::from_secs(10);

async fn bounded<T>(what: &str, future: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::time::timeout(IO_TIMEOUT, future)
        .await
        .map_err(|_| anyhow!("{what}: timed out after {IO_TIMEOUT:?}"))?
}

/// An HTTP/1.1 connection (plain or TLS) that can carry several requests.
pub struct HttpConnection {
    sender: SendRequest<Full<Bytes>>,
    host: String,
    driver: JoinHandle<()>,
}

impl HttpConnection {
    async fn handshake<Io>(io: Io, host: String) -> Result<Self>
    where
        Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(io))
            .await
            .context("http handshake")?;
        let driver = tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(Self {
            sender,
            host,
            driver,
        })
    }

    /// Plain HTTP to `addr`.
    pub async fn plain(addr: SocketAddr) -> Result<Self> {
        bounded("http connect", async {
            let stream = TcpStream::connect(addr)
                .await
                .with_context(|| format!("connect {addr}"))?;
            Self::handshake(stream, addr.to_string()).await
        })
        .await
    }

    /// Sends one request and reads the whole response: `(status, body)`.
    pub async fn request(
        &mut self,
        method: Method,
        path: &str,
        body: Vec<u8>,
    ) -> Result<(u16, String)> {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", &self.host)
            .body(Full::new(Bytes::from(body)))?;
        bounded("http request", async {
            self.sender.ready().await.context("connection not usable")?;
            let response = self.sender.send_request(request).await?;
            let status = response.status().as_u16();
            let body = response.into_body().collect().await?.to_bytes();
            Ok((status, String::from_utf8_lossy(&body).into_owned()))
        })
        .await
    }

    /// `GET path`.
    pub async fn get(&mut self, path: &str) -> Result<(u16, String)> {
        self.request(Method::GET, path, Vec::new()).await
    }

    /// Starts `GET path` and returns the response body as a line stream.
    pub async fn watch(mut self, path: &str) -> Result<WatchStream> {
        let request = Request::builder()
            .uri(path)
            .header("host", &self.host)
            .body(Full::new(Bytes::new()))?;
        let response = bounded("watch request", async {
            self.sender.ready().await?;
            Ok(self.sender.send_request(request).await?)
        })
        .await?;
        ensure!(
            response.status().is_success(),
            "watch: status {}",
            response.status()
        );
        Ok(WatchStream {
            body: response.into_body(),
            pending: Vec::new(),
            _connection: self,
        })
    }

    /// Whether the underlying connection has ended.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed() || self.driver.is_finished()
    }
}

impl Drop for HttpConnection {
    fn drop(&mut self) {
        self.driver.abort();
    }
}

/// A streaming response read line by line (the fake apiserver's `/watch`).
pub struct WatchStream {
    body: Incoming,
    pending: Vec<u8>,
    _connection: HttpConnection,
}

impl WatchStream {
    /// The next line, or an error if the stream ended or `deadline` passed first.
    pub async fn next_line(&mut self, deadline: Duration) -> Result<String> {
        tokio::time::timeout(deadline, async {
            loop {
                if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = self.pending.drain(..=end).collect();
                    return Ok(String::from_utf8_lossy(&line).trim_end().to_owned());
                }
                match self.body.frame().await {
                    Some(Ok(frame)) => {
                        if let Ok(data) = frame.into_data() {
                            self.pending.extend_from_slice(&data);
                        }
                    }
                    Some(Err(error)) => bail!("watch stream broke: {error}"),
                    None => bail!("watch stream ended"),
                }
            }
        })
        .await
        .map_err(|_| anyhow!("no watch line within {deadline:?}"))?
    }

    /// Reads until the stream ends (cleanly or not); errors if it is still open at `deadline`.
    /// Returns the number of lines read meanwhile.
    pub async fn wait_cut(&mut self, deadline: Duration) -> Result<u64> {
        let mut lines = 0;
        let start = tokio::time::Instant::now();
        loop {
            let left = deadline.saturating_sub(start.elapsed());
            ensure!(
                !left.is_zero(),
                "watch stream still open after {deadline:?} ({lines} more lines)"
            );
            match self.next_line(left).await {
                Ok(_) => lines += 1,
                Err(error) if error.to_string().starts_with("no watch line") => {
                    bail!("watch stream still open after {deadline:?} ({lines} more lines)")
                }
                Err(_) => return Ok(lines),
            }
        }
    }
}

/// HTTPS to a (fake) apiserver reached at any address, verifying the name `kubernetes`.
#[derive(Clone)]
pub struct HttpsClient {
    connector: tokio_rustls::TlsConnector,
    server_name: ServerName<'static>,
}

impl HttpsClient {
    /// A client with `config` (see [`crate::certs::Pki::client_config`]).
    pub fn new(config: Arc<rustls::ClientConfig>) -> Self {
        Self {
            connector: tokio_rustls::TlsConnector::from(config),
            server_name: ServerName::try_from(SERVER_NAME).expect("valid name"),
        }
    }

    /// A keep-alive HTTPS connection to `addr`.
    pub async fn connect(&self, addr: SocketAddr) -> Result<HttpConnection> {
        bounded("https connect", async {
            let stream = TcpStream::connect(addr)
                .await
                .with_context(|| format!("connect {addr}"))?;
            let tls = self
                .connector
                .connect(self.server_name.clone(), stream)
                .await
                .context("tls handshake")?;
            HttpConnection::handshake(tls, SERVER_NAME.to_owned()).await
        })
        .await
    }

    /// `GET path` on a fresh connection.
    pub async fn get(&self, addr: SocketAddr, path: &str) -> Result<(u16, String)> {
        self.connect(addr).await?.get(path).await
    }

    /// `POST path` with `body` on a fresh connection.
    pub async fn post(&self, addr: SocketAddr, path: &str, body: Vec<u8>) -> Result<(u16, String)> {
        self.connect(addr)
            .await?
            .request(Method::POST, path, body)
            .await
    }

    /// Opens a `/watch`-like stream on a fresh connection.
    pub async fn watch(&self, addr: SocketAddr, path: &str) -> Result<WatchStream> {
        self.connect(addr).await?.watch(path).await
    }
}

/// `GET http://addr/path` (the proxy's admin endpoint): `(status, body)`.
pub async fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String)> {
    HttpConnection::plain(addr).await?.get(path).await
}

/// [`http_get`] within `timeout` (a probe that must not wait as long as [`IO_TIMEOUT`]).
pub async fn http_get_within(
    addr: SocketAddr,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String)> {
    tokio::time::timeout(timeout, http_get(addr, path))
        .await
        .map_err(|_| anyhow!("GET http://{addr}{path}: no answer within {timeout:?}"))?
}

/// A raw TCP client for byte-level tests.
pub struct TcpClient {
    stream: TcpStream,
}

impl TcpClient {
    /// Connects (bounded by [`IO_TIMEOUT`]).
    pub async fn connect(addr: SocketAddr) -> Result<Self> {
        let stream = bounded("tcp connect", async {
            TcpStream::connect(addr)
                .await
                .with_context(|| format!("connect {addr}"))
        })
        .await?;
        stream.set_nodelay(true)?;
        Ok(Self { stream })
    }

    /// Writes `data` and expects exactly `data` back (an echo backend).
    pub async fn round_trip(&mut self, data: &[u8]) -> Result<()> {
        bounded("round trip", async {
            self.stream.write_all(data).await.context("write")?;
            let mut back = vec![0u8; data.len()];
            self.stream
                .read_exact(&mut back)
                .await
                .context("read echo")?;
            ensure!(back == data, "echo differs from what was sent");
            Ok(())
        })
        .await
    }

    /// Writes all of `data`.
    pub async fn write_all(&mut self, data: &[u8]) -> Result<()> {
        bounded("write", async { Ok(self.stream.write_all(data).await?) }).await
    }

    /// Shuts down the write side (sends FIN), keeps reading possible.
    pub async fn shutdown_write(&mut self) -> Result<()> {
        Ok(self.stream.shutdown().await?)
    }

    /// Reads until EOF, bounded by `deadline`.
    pub async fn read_to_end(&mut self, deadline: Duration) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        tokio::time::timeout(deadline, self.stream.read_to_end(&mut out))
            .await
            .map_err(|_| anyhow!("no EOF within {deadline:?} ({} bytes read)", out.len()))??;
        Ok(out)
    }

    /// Waits until the peer closes the connection (EOF or reset); data read meanwhile is
    /// discarded. Errors if it is still open at `deadline`.
    pub async fn wait_closed(&mut self, deadline: Duration) -> Result<()> {
        self.read_to_close(deadline).await.map(|_ended| ())
    }

    /// Waits until the peer ends the connection with a FIN (reads reach EOF), at most
    /// `deadline`; a reset is an error.
    pub async fn wait_eof(&mut self, deadline: Duration) -> Result<()> {
        self.read_to_close(deadline)
            .await?
            .map_err(|e| anyhow!("connection ended with an error, not a FIN: {e}"))
    }

    /// Reads and discards until the connection ends, at most `deadline`: how it ended (EOF,
    /// or the read's error), or an error if it is still open then.
    async fn read_to_close(&mut self, deadline: Duration) -> Result<std::io::Result<()>> {
        let mut buf = [0u8; 4096];
        tokio::time::timeout(deadline, async {
            loop {
                match self.stream.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(_) => {}
                    Err(e) => return Err(e),
                }
            }
        })
        .await
        .map_err(|_| anyhow!("connection still open after {deadline:?}"))
    }

    /// The underlying stream.
    pub fn stream(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Gives up the wrapper.
    pub fn into_inner(self) -> TcpStream {
        self.stream
    }
}

/// A metrics address with TLS and client certificates answers neither a TLS client without a
/// certificate of `pki`'s CA nor plain HTTP: `tries` attempts of each, all refused.
pub async fn ensure_scrapes_refused(
    addr: SocketAddr,
    pki: &crate::certs::Pki,
    tries: usize,
) -> Result<()> {
    let anonymous = HttpsClient::new(pki.client_config(false)?);
    for i in 0..tries {
        if let Ok((code, _)) = anonymous.get(addr, "/metrics").await {
            bail!("scrape {i} without a client certificate answered HTTP {code}");
        }
        if let Ok((code, _)) = http_get(addr, "/metrics").await {
            bail!("plain-HTTP scrape {i} answered HTTP {code}");
        }
    }
    Ok(())
}
