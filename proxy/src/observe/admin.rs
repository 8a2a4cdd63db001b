//! The admin HTTP endpoint: `/metrics`, `/healthz`, `/readyz`, `/status`, `/peer-ready`.
//!
//! Each pod probes its own admin endpoint (never the shared public port). Only `GET` and `HEAD`
//! are served; anything else is rejected and counted. Requests are small and bounded.
//!
//! `/peer-ready` answers 200 while another instance on the node is ready (Serving with its own
//! apiserver healthy: one that would take our listening sockets). A pod that is deleted waits
//! for it in a `preStop` hook (`probe --path=/peer-ready --wait=…`) before it stops, so a
//! deleted or evicted pod keeps serving until its replacement can.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{Encoder, IntCounter, Registry, TextEncoder};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backends::backend::Backends;
use crate::backends::readiness::Readiness;
use crate::base::lifecycle::State;
use crate::base::metrics::ProcessGauges;
use crate::data::listener::Listeners;
use crate::data::metrics::DataMetrics;
use crate::handoff::Handoff;

/// Most admin connections served at once; more wait in the kernel backlog.
const MAX_ADMIN_CONNECTIONS: usize = 32;

pub const ADMIN_REQUESTS_REJECTED: &str = "admin_requests_rejected_total";

/// `admin_requests_rejected_total`, registered on `r`.
pub fn rejected_counter(r: &Registry) -> IntCounter {
    crate::base::metrics::counter(
        r,
        ADMIN_REQUESTS_REJECTED,
        "Admin requests rejected (bad method, path or size).",
    )
}
/// Time a client has to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest request head accepted.
const MAX_REQUEST_HEAD: usize = 16 * 1024;

/// What the admin endpoint reads.
pub struct AdminView {
    pub state: watch::Receiver<State>,
    pub backends: Arc<Backends>,
    pub listeners: Arc<Listeners>,
    pub registry: Registry,
    /// The data path's counters of the client-address mode (for `/status`).
    pub data: DataMetrics,
    /// Read before every scrape.
    pub process: ProcessGauges,
    /// `admin_requests_rejected_total` ([`rejected_counter`]).
    pub rejected: IntCounter,
    /// `/readyz`: Serving and the own backend (or any backend) up.
    pub readiness: Readiness,
    /// The handoff side, if on: `/status` lists its peers.
    pub handoff: Option<Arc<Handoff>>,
    /// `--client-address`: `/status` says what the apiservers see.
    pub client_address: crate::cli::ClientAddress,
    /// Set (to the successor's pid) once an in-place upgrade has handed everything to the
    /// ready successor: a probe this instance accepted just before it stopped answering on the
    /// admin socket, and answers after it left `Serving`, is answered ready (the pod is: its
    /// successor serves). Never reported to handoff peers.
    pub handed_to_successor: std::sync::atomic::AtomicU32,
}

impl AdminView {
    /// Ready: Serving, and the own backend is up (or, without `--own-backend-file`, any backend).
    pub fn ready(&self) -> bool {
        self.readiness.ready()
    }

    fn status(&self) -> serde_json::Value {
        let transparent = self.client_address == crate::cli::ClientAddress::Transparent;
        let backends: Vec<serde_json::Value> = self
            .backends
            .snapshot()
            .iter()
            .map(|b| {
                let health = b.health();
                // What this backend sees as the client's address.
                let client_address = if !transparent {
                    "proxy".to_string()
                } else if b.addr.0.ip().is_loopback() {
                    format!("transparent: {}", b.transparent.describe())
                } else {
                    "client (not on loopback: connected normally, it sees the node's address)"
                        .into()
                };
                serde_json::json!({
                    "client_address": client_address,
                    "address": b.addr.to_string(),
                    "source": b.tier,
                    "healthy": health.is_up(),
                    "health": health,
                    "active_connections": b.active(),
                    "last_check": b.last_check().map(|c| serde_json::json!({
                        "result": c.obs.as_str(),
                        "cause": c.cause,
                    })),
                })
            })
            .collect();
        serde_json::json!({
            "state": *self.state.borrow(),
            "ready": self.ready(),
            "listeners": self.listeners.info(),
            "backends": backends,
            "client_address": {
                "mode": if transparent { "transparent" } else { "proxy" },
                "transparent_connections": self.data.client_address_transparent.get(),
                "fallback_connections": self.data.client_address_fallback.get(),
            },
            "peers": self
                .handoff
                .as_ref()
                .map(|h| h.peers_json())
                .unwrap_or_else(|| serde_json::json!([])),
            "version": env!("CARGO_PKG_VERSION"),
            "pid": std::process::id(),
        })
    }

    /// This instance's metrics in the Prometheus text format (gauges read at scrape time are
    /// refreshed first).
    pub async fn metrics_text(&self) -> Result<Vec<u8>, prometheus::Error> {
        self.process.refresh().await;
        let mut buf = Vec::with_capacity(16 * 1024);
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(buf)
    }

    /// This instance's metrics as a response (500 when they cannot be encoded).
    pub async fn metrics_response(&self) -> Response<Full<Bytes>> {
        match self.metrics_text().await {
            Ok(body) => Response::builder()
                .header(
                    hyper::header::CONTENT_TYPE,
                    TextEncoder::new().format_type(),
                )
                .body(Full::new(Bytes::from(body)))
                .expect("valid response"),
            Err(_) => text(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n"),
        }
    }

    /// Answers one admin request.
    pub async fn handle(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        match req.uri().path() {
            "/metrics" if req.method() == Method::GET || req.method() == Method::HEAD => {
                self.metrics_response().await
            }
            "/peer-ready" if req.method() == Method::GET || req.method() == Method::HEAD => {
                // On a task of its own: a probe that gives up must not cut the exchange with
                // a peer halfway (the peer would count a rejected message).
                let ready = match self.handoff.clone() {
                    Some(h) => tokio::spawn(async move { h.ready_peer().await })
                        .await
                        .unwrap_or(false),
                    None => false,
                };
                if ready {
                    text(StatusCode::OK, "ok\n")
                } else {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "no ready peer on this node\n",
                    )
                }
            }
            _ => self.respond(&req),
        }
    }

    fn respond(&self, req: &Request<Incoming>) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            self.rejected.inc();
            return text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
        }
        match req.uri().path() {
            "/healthz" | "/livez" => text(StatusCode::OK, "ok\n"),
            "/readyz" => {
                let handed = self
                    .handed_to_successor
                    .load(std::sync::atomic::Ordering::Acquire);
                if self.ready() || handed != 0 {
                    text(StatusCode::OK, "ok\n")
                } else {
                    let state = *self.state.borrow();
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        &format!("not ready: {state}\n"),
                    )
                }
            }
            "/status" => {
                let body = serde_json::to_vec_pretty(&self.status()).expect("status serializes");
                Response::builder()
                    .header(hyper::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .expect("valid response")
            }
            _ => {
                self.rejected.inc();
                text(StatusCode::NOT_FOUND, "not found\n")
            }
        }
    }
}

/// A plain-text response.
pub fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .header(hyper::header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .body(Full::new(Bytes::from(body.to_string())))
        .expect("valid response")
}

/// The admin endpoint's listening socket, and whether it was inherited from the predecessor
/// of an in-place upgrade (which then answers on it until it has handed everything over).
pub struct AdminSocket {
    pub listener: TcpListener,
    /// The predecessor's pid, when the socket is inherited.
    pub predecessor: Option<u32>,
}

/// Binds the admin endpoint (or takes the socket inherited from the predecessor of an
/// in-place upgrade); writes the bound address to `address_file` if given.
pub async fn bind(addr: SocketAddr, address_file: Option<&Path>) -> std::io::Result<AdminSocket> {
    let (listener, predecessor) = match crate::instance::upgrade::inherited_admin(addr) {
        Some((inherited, predecessor)) => {
            inherited.set_nonblocking(true)?;
            tracing::info!(
                predecessor.pid = predecessor,
                "admin socket inherited from the predecessor"
            );
            (TcpListener::from_std(inherited)?, Some(predecessor))
        }
        None => (TcpListener::bind(addr).await?, None),
    };
    if let Some(path) = address_file {
        crate::base::fsutil::write_atomic(
            path,
            format!("{}\n", listener.local_addr()?).as_bytes(),
        )?;
    }
    Ok(AdminSocket {
        listener,
        predecessor,
    })
}

/// Serves admin requests until `stop`; each connection is a task on `tasks` and ends at `stop`.
pub async fn serve(
    listener: TcpListener,
    view: Arc<AdminView>,
    stop: CancellationToken,
    tasks: TaskTracker,
) {
    let handler = move |req: Request<Incoming>| {
        let view = view.clone();
        async move { view.handle(req).await }
    };
    serve_with(listener, handler, true, None, stop, tasks).await;
}

/// Serves HTTP/1 requests with `handler` until `stop`, bounded like the admin endpoint: at most
/// `MAX_ADMIN_CONNECTIONS` at once, small request heads read within a deadline; without
/// `keep_alive` every response closes its connection; with `tls`, each connection's handshake
/// must finish within the same deadline. Each connection is a task on `tasks`. At `stop` no
/// new connection is accepted, and those being served finish their request (within the
/// header deadline): a probe answered by an instance that stops still gets its answer.
pub async fn serve_with<H, F>(
    listener: TcpListener,
    handler: H,
    keep_alive: bool,
    tls: Option<Arc<rustls::ServerConfig>>,
    stop: CancellationToken,
    tasks: TaskTracker,
) where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let slots = Arc::new(Semaphore::new(MAX_ADMIN_CONNECTIONS));
    let tls = tls.map(tokio_rustls::TlsAcceptor::from);
    loop {
        let permit = tokio::select! {
            _ = stop.cancelled() => return,
            p = slots.clone().acquire_owned() => p.expect("semaphore open"),
        };
        let (stream, _) = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "admin accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let handler = handler.clone();
        let stop = stop.clone();
        let tls = tls.clone();
        tasks.spawn(async move {
            match tls {
                None => serve_connection(stream, handler, keep_alive, stop).await,
                Some(acceptor) => {
                    match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => serve_connection(stream, handler, keep_alive, stop).await,
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "TLS handshake failed");
                        }
                        Err(_) => tracing::debug!("TLS handshake timed out"),
                    }
                }
            }
            drop(permit);
        });
    }
}

/// One HTTP/1 connection until it ends; at `stop`, the request in progress is answered and
/// the connection then closed.
async fn serve_connection<S, H, F>(stream: S, handler: H, keep_alive: bool, stop: CancellationToken)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: std::future::Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    // A request arrived (a permit is stored when nobody waits yet).
    let requested = Arc::new(tokio::sync::Notify::new());
    let on_request = requested.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        on_request.notify_one();
        let response = handler(req);
        async move { Ok::<_, Infallible>(response.await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(MAX_REQUEST_HEAD)
        .keep_alive(keep_alive)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        _ = stop.cancelled() => {
            // A connection accepted before the stop gets its answer: hyper's graceful shutdown
            // closes a connection whose request it has not read yet, so wait for the request
            // first (within the header deadline), then shut down after its answer. (An
            // in-place upgrade's probe that lands on the old process in its last moment.)
            let first = tokio::select! {
                r = conn.as_mut() => Some(r),
                _ = requested.notified() => None,
                _ = tokio::time::sleep(HEADER_TIMEOUT) => None,
            };
            match first {
                Some(r) => r,
                None => {
                    conn.as_mut().graceful_shutdown();
                    match tokio::time::timeout(HEADER_TIMEOUT, conn.as_mut()).await {
                        Ok(r) => r,
                        Err(_) => Ok(()),
                    }
                }
            }
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "admin connection ended with error");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::data::forward::ForwardContext;

    /// An admin endpoint served on `127.0.0.1:0`, in `state`, its backends ready or not.
    struct Admin {
        addr: SocketAddr,
        view: Arc<AdminView>,
        state: watch::Sender<State>,
        stop: CancellationToken,
    }

    impl Drop for Admin {
        fn drop(&mut self) {
            self.stop.cancel();
        }
    }

    async fn admin(state: State, backend_ready: bool) -> Admin {
        let registry = Registry::new();
        let stop = CancellationToken::new();
        let ctx = Arc::new(ForwardContext {
            cut: stop.child_token(),
            ..ForwardContext::for_tests(&registry, &stop)
        });
        let (backends, data) = (ctx.backends.clone(), ctx.metrics.clone());
        let listeners = Arc::new(Listeners::new(
            ctx,
            16,
            crate::data::workers::Placement::Shared,
            stop.child_token(),
        ));
        let (state, rx) = watch::channel(state);
        let view = Arc::new(AdminView {
            state: rx.clone(),
            backends,
            listeners,
            process: ProcessGauges::register(&registry),
            rejected: rejected_counter(&registry),
            registry,
            data,
            readiness: Readiness::from_fn(rx, move || backend_ready),
            handoff: None,
            client_address: crate::cli::ClientAddress::Proxy,
            handed_to_successor: std::sync::atomic::AtomicU32::new(0),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(serve(
            listener,
            view.clone(),
            stop.clone(),
            TaskTracker::new(),
        ));
        Admin {
            addr,
            view,
            state,
            stop,
        }
    }

    /// What came back: status, `Content-Type`, body.
    #[derive(Debug)]
    struct Answer {
        status: u16,
        content_type: String,
        body: String,
    }

    /// One HTTP/1.1 request on a connection of its own, read to the end.
    async fn request(addr: SocketAddr, method: &str, path: &str) -> Answer {
        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        let head = format!("{method} {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n\r\n");
        conn.write_all(head.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut raw))
            .await
            .expect("the admin endpoint did not answer")
            .unwrap();
        let raw = String::from_utf8(raw).unwrap();
        let (head, body) = raw.split_once("\r\n\r\n").expect("a response head");
        let mut lines = head.lines();
        let status = lines
            .next()
            .unwrap()
            .split(' ')
            .nth(1)
            .unwrap()
            .parse()
            .unwrap();
        let content_type = lines
            .filter_map(|l| l.split_once(": "))
            .find(|(name, _)| name.eq_ignore_ascii_case("content-type"))
            .map(|(_, value)| value.to_string())
            .unwrap_or_default();
        Answer {
            status,
            content_type,
            body: body.to_string(),
        }
    }

    const TEXT: &str = "text/plain; charset=utf-8";

    #[tokio::test]
    async fn each_route_answers_with_its_status_body_and_type() {
        let a = admin(State::Serving, true).await;
        for path in ["/healthz", "/livez", "/readyz"] {
            let r = request(a.addr, "GET", path).await;
            assert_eq!((r.status, r.body.as_str()), (200, "ok\n"), "{path}");
            assert_eq!(r.content_type, TEXT, "{path}");
        }
        let r = request(a.addr, "GET", "/status").await;
        assert_eq!(
            (r.status, r.content_type.as_str()),
            (200, "application/json")
        );
        let status: serde_json::Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(status["state"], "Serving", "{status}");
        assert_eq!(status["ready"], true, "{status}");
        assert_eq!(status["client_address"]["mode"], "proxy", "{status}");
        assert_eq!(status["version"], env!("CARGO_PKG_VERSION"), "{status}");
        let r = request(a.addr, "GET", "/metrics").await;
        assert_eq!(r.status, 200);
        assert_eq!(r.content_type, TextEncoder::new().format_type());
        assert!(
            r.body.contains("kube_apiserver_proxy_build_info{"),
            "{}",
            r.body
        );
        // No handoff: no peer can be ready.
        let r = request(a.addr, "GET", "/peer-ready").await;
        assert_eq!(
            (r.status, r.body.as_str(), r.content_type.as_str()),
            (503, "no ready peer on this node\n", TEXT)
        );
        let r = request(a.addr, "HEAD", "/healthz").await;
        assert_eq!((r.status, r.body.as_str()), (200, ""), "HEAD has no body");
        assert_eq!(a.view.rejected.get(), 0);
    }

    #[tokio::test]
    async fn readyz_says_why_not_until_serving_with_a_backend_or_handed_over() {
        let a = admin(State::WaitingForBackend, true).await;
        let r = request(a.addr, "GET", "/readyz").await;
        assert_eq!(
            (r.status, r.body.as_str(), r.content_type.as_str()),
            (503, "not ready: WaitingForBackend\n", TEXT)
        );
        a.state.send_replace(State::Serving);
        assert_eq!(request(a.addr, "GET", "/readyz").await.status, 200);
        a.state.send_replace(State::Draining);
        let r = request(a.addr, "GET", "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (503, "not ready: Draining\n"));
        // Handed to the successor of an in-place upgrade: the pod is ready, the successor serves.
        a.view
            .handed_to_successor
            .store(42, std::sync::atomic::Ordering::Release);
        assert_eq!(request(a.addr, "GET", "/readyz").await.status, 200);

        let a = admin(State::Serving, false).await;
        let r = request(a.addr, "GET", "/readyz").await;
        assert_eq!((r.status, r.body.as_str()), (503, "not ready: Serving\n"));
    }

    #[tokio::test]
    async fn unknown_path_is_404_and_other_methods_405_both_counted() {
        let a = admin(State::Serving, true).await;
        let r = request(a.addr, "GET", "/nope").await;
        assert_eq!(
            (r.status, r.body.as_str(), r.content_type.as_str()),
            (404, "not found\n", TEXT)
        );
        assert_eq!(a.view.rejected.get(), 1);
        for (method, path) in [
            ("POST", "/healthz"),
            ("PUT", "/readyz"),
            ("DELETE", "/status"),
            ("POST", "/metrics"),
            ("POST", "/peer-ready"),
            ("POST", "/nope"),
        ] {
            let r = request(a.addr, method, path).await;
            assert_eq!(
                (r.status, r.body.as_str(), r.content_type.as_str()),
                (405, "method not allowed\n", TEXT),
                "{method} {path}"
            );
        }
        assert_eq!(a.view.rejected.get(), 7);
    }
}
