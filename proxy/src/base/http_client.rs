//! One HTTP/1 request of the proxy's own: the health check's `GET`, `probe`, the node scrape's
//! fan-out to its peers and the checkpoint writer's API calls.
//!
//! The caller connects ([`connect`], then [`tls`] for https) and builds the request (its
//! `Host`, `Accept`, … are the caller's); [`request`] sends it over that stream and reads the
//! status and the body up to a size limit, driving the connection beside the request (no task
//! of its own outlives it). [`within`] puts the whole exchange, connect included, under one
//! deadline. Every failure is an [`HttpError`] naming the step, with the error underneath as
//! its source.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt as _, Limited};
use hyper::body::Bytes;
use hyper::StatusCode;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// An error of a lower layer that hyper's body or rustls may give, boxed.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a request got no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("resolve {host}: {source}")]
    Resolve {
        host: String,
        #[source]
        source: std::io::Error,
    },
    #[error("resolve {host}: no address")]
    NoAddress { host: String },
    #[error("connect {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("tls handshake: {0}")]
    Tls(#[source] std::io::Error),
    #[error("http handshake: {0}")]
    Handshake(#[source] hyper::Error),
    #[error("request: {0}")]
    Request(#[from] hyper::http::Error),
    #[error("send: {0}")]
    Send(#[source] hyper::Error),
    #[error("connection: {0}")]
    Connection(#[source] hyper::Error),
    #[error("body: {0}")]
    Body(#[source] BoxError),
    /// An answer, but not with a status the caller takes (`excerpt`: the body's start, if the
    /// caller wants it shown).
    #[error("HTTP {status}{}", excerpt_suffix(.excerpt))]
    Status { status: StatusCode, excerpt: String },
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

fn excerpt_suffix(excerpt: &str) -> String {
    if excerpt.is_empty() {
        String::new()
    } else {
        format!(": {excerpt}")
    }
}

impl HttpError {
    /// Whether nobody listens at the address (connection refused).
    pub fn is_refused(&self) -> bool {
        matches!(self, HttpError::Connect { source, .. }
            if source.kind() == std::io::ErrorKind::ConnectionRefused)
    }
}

/// The status and body of an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: StatusCode,
    pub body: Bytes,
}

impl Answer {
    /// The body, if `accept` takes the status; otherwise [`HttpError::Status`] with the body's
    /// first `excerpt` characters.
    pub fn accept(
        self,
        accept: impl Fn(StatusCode) -> bool,
        excerpt: usize,
    ) -> Result<Bytes, HttpError> {
        if accept(self.status) {
            return Ok(self.body);
        }
        Err(HttpError::Status {
            status: self.status,
            excerpt: excerpt_of(&String::from_utf8_lossy(&self.body), excerpt),
        })
    }
}

/// The first `chars` characters of `text` (cut on a character, never inside one).
pub fn excerpt_of(text: &str, chars: usize) -> String {
    text.chars().take(chars).collect()
}

/// `fut`, or [`HttpError::Timeout`] once `timeout` has passed.
pub async fn within<T>(
    timeout: Duration,
    fut: impl std::future::Future<Output = Result<T, HttpError>>,
) -> Result<T, HttpError> {
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or(Err(HttpError::Timeout(timeout)))
}

/// The first address of `host:port`.
pub async fn resolve(host: &str, port: u16) -> Result<SocketAddr, HttpError> {
    tokio::net::lookup_host((host, port))
        .await
        .map_err(|source| HttpError::Resolve {
            host: host.to_owned(),
            source,
        })?
        .next()
        .ok_or_else(|| HttpError::NoAddress {
            host: host.to_owned(),
        })
}

/// A TCP connection to `addr`, without Nagle's delay.
pub async fn connect(addr: SocketAddr) -> Result<TcpStream, HttpError> {
    let tcp = TcpStream::connect(addr)
        .await
        .map_err(|source| HttpError::Connect { addr, source })?;
    let _ = tcp.set_nodelay(true);
    Ok(tcp)
}

/// The TLS handshake over `tcp`, verifying the server as `name`.
pub async fn tls(
    config: Arc<rustls::ClientConfig>,
    name: rustls::pki_types::ServerName<'static>,
    tcp: TcpStream,
) -> Result<tokio_rustls::client::TlsStream<TcpStream>, HttpError> {
    tokio_rustls::TlsConnector::from(config)
        .connect(name, tcp)
        .await
        .map_err(HttpError::Tls)
}

/// Sends `req` over `stream` (plain or TLS, connected) and reads the answer: its status and
/// at most `max_body` bytes of body (more is [`HttpError::Body`]). The connection is driven
/// here, beside the request, and closed when this returns. No deadline of its own: see
/// [`within`].
pub async fn request<S, B>(
    stream: S,
    req: hyper::Request<B>,
    max_body: usize,
) -> Result<Answer, HttpError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake::<_, B>(TokioIo::new(stream))
        .await
        .map_err(HttpError::Handshake)?;
    let exchange = async move {
        let resp = sender.send_request(req).await.map_err(HttpError::Send)?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), max_body)
            .collect()
            .await
            .map_err(HttpError::Body)?
            .to_bytes();
        Ok(Answer { status, body })
    };
    let mut exchange = std::pin::pin!(exchange);
    let mut conn = std::pin::pin!(conn);
    let ended = tokio::select! {
        biased;
        answer = &mut exchange => return answer,
        ended = &mut conn => ended,
    };
    // The connection ended first (a server that closes after its answer, or one that fails):
    // what it delivered before is complete in the exchange, or the exchange fails at once.
    match (exchange.await, ended) {
        (Ok(answer), _) => Ok(answer),
        (Err(_), Err(e)) => Err(HttpError::Connection(e)),
        (Err(e), Ok(())) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Empty;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// A server that answers one request on 127.0.0.1 with `answer`, then closes.
    async fn answering(answer: &'static [u8]) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(answer).await;
        });
        addr
    }

    fn get() -> hyper::Request<Empty<Bytes>> {
        hyper::Request::get("/x")
            .header(hyper::header::HOST, "h")
            .body(Empty::new())
            .unwrap()
    }

    #[tokio::test]
    async fn status_and_body_of_an_answer_that_closes_its_connection() {
        let addr =
            answering(b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n\r\nnot ready")
                .await;
        let tcp = connect(addr).await.unwrap();
        let answer = request(tcp, get(), 1024).await.unwrap();
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(&answer.body[..], b"not ready");
        let e = answer.accept(|s| s == StatusCode::OK, 3).unwrap_err();
        assert_eq!(e.to_string(), "HTTP 503 Service Unavailable: not");
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_an_error() {
        let addr = answering(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789").await;
        let e = request(connect(addr).await.unwrap(), get(), 4)
            .await
            .unwrap_err();
        assert!(matches!(e, HttpError::Body(_)), "{e}");
    }

    #[tokio::test]
    async fn refused_timeout_and_garbage_are_told_apart() {
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let e = connect(closed).await.unwrap_err();
        assert!(e.is_refused(), "{e}");
        // Accepts (the backlog) and never answers.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let e = within(Duration::from_millis(100), async {
            request(connect(addr).await?, get(), 1024).await
        })
        .await
        .unwrap_err();
        assert!(matches!(e, HttpError::Timeout(_)), "{e}");
        let addr = answering(b"SSH-2.0-OpenSSH\r\n").await;
        let e = request(connect(addr).await.unwrap(), get(), 1024)
            .await
            .unwrap_err();
        assert!(
            matches!(e, HttpError::Connection(_) | HttpError::Send(_)),
            "{e:?}"
        );
    }
}
