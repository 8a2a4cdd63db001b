//! A reusable fake kube-apiserver, in-process (tokio) or as the `fake-apiserver` binary.
//!
//! Two kinds of server, chosen by the builder:
//! - **https** ([`FakeApiserver::https`]): rustls (ring) + hyper 1, optional client-certificate
//!   requirement. Endpoints: `GET /readyz` (200 `ok` or 503, switchable), `GET /livez`,
//!   `GET /healthz`, `GET /version` (JSON), `POST /echo` (echoes the body),
//!   `GET /watch[?interval_ms=N]` (chunked, one line every N ms until the client goes away) and
//!   `GET /slow?ms=N` (answers after N ms: an in-flight request), and `GET` of any path given
//!   to [`FakeApiserverBuilder::object`] (its JSON; with [`FakeApiserverBuilder::bearer_token`],
//!   only to requests carrying that token, 401 to others; replaced at run time with
//!   [`FakeApiserver::set_object`]). A client certificate given to
//!   [`FakeApiserver::revoke_client_cert`] gets 401 on every object, as the real apiserver
//!   answers an expired one.
//! - **raw TCP** ([`FakeApiserver::tcp_echo`], [`FakeApiserver::tcp_sink`]): for byte-exact
//!   forwarding tests. Echo writes back every byte and closes its write side after reading
//!   EOF; sink reads until EOF, then answers `<bytes received>\n` and closes.
//!
//! Controls: [`FakeApiserver::set_ready`], [`FakeApiserver::stop_listening`] (listener closed,
//! established connections kept: new connects are refused), [`FakeApiserver::vanish`] (listener
//! and every connection closed, like a killed process), and counters of accepted/active
//! connections, data sessions, watches and requests per path.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{Context as _, Result};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Bytes, Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::certs::Pki;

/// The ring crypto provider, explicitly (the workspace never relies on a process default).
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The `/version` body.
pub const VERSION_JSON: &str =
    r#"{"major":"1","minor":"31","gitVersion":"v1.31.0-fake","platform":"linux/amd64"}"#;

/// Default pause between two `/watch` lines.
pub const DEFAULT_WATCH_INTERVAL: Duration = Duration::from_millis(50);

type ResponseBody = UnsyncBoxBody<Bytes, Infallible>;

/// What the server speaks.
enum Protocol {
    Https {
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        client_ca: Option<RootCertStore>,
    },
    TcpEcho,
    TcpSink,
}

/// Builder for [`FakeApiserver`]; see the module docs.
pub struct FakeApiserverBuilder {
    protocol: Protocol,
    addr: SocketAddr,
    ready: bool,
    ready_file: Option<PathBuf>,
    watch_interval: Duration,
    objects: HashMap<String, String>,
    bearer_token: Option<String>,
    reuse_port: bool,
    rollout_time: Duration,
    never_ready: Option<(String, Duration)>,
}

impl FakeApiserverBuilder {
    fn new(protocol: Protocol) -> Self {
        Self {
            protocol,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            ready: true,
            ready_file: None,
            watch_interval: DEFAULT_WATCH_INTERVAL,
            objects: HashMap::new(),
            bearer_token: None,
            reuse_port: false,
            rollout_time: Duration::ZERO,
            never_ready: None,
        }
    }

    /// Binds with `SO_REUSEPORT` (kube-apiserver's `--permit-port-sharing`).
    pub fn reuse_port(mut self, on: bool) -> Self {
        self.reuse_port = on;
        self
    }

    /// Serves `json` at `GET path` (e.g. `/api/v1/namespaces/kube-system/pods/p`).
    pub fn object(mut self, path: &str, json: &serde_json::Value) -> Self {
        self.objects.insert(path.to_owned(), json.to_string());
        self
    }

    /// A `PUT` of a served Deployment completes its rollout this long after it (default at
    /// once): until then its status says the new replica is not updated yet.
    pub fn rollout_time(mut self, time: Duration) -> Self {
        self.rollout_time = time;
        self
    }

    /// A `PUT` of a Deployment whose JSON contains `marker` starts a rollout that never
    /// completes (its new pod never gets ready): after `deadline` (its
    /// `progressDeadlineSeconds`) its status reports `Progressing` false with
    /// `ProgressDeadlineExceeded`, as the Deployment controller does.
    pub fn never_ready_with(mut self, marker: &str, deadline: Duration) -> Self {
        self.never_ready = Some((marker.to_owned(), deadline));
        self
    }

    /// Objects are served only to requests with `Authorization: Bearer <token>`.
    pub fn bearer_token(mut self, token: &str) -> Self {
        self.bearer_token = Some(token.to_owned());
        self
    }

    /// Address to bind (default `127.0.0.1:0`); any `127.x.y.z` works on Linux.
    pub fn bind(mut self, addr: SocketAddr) -> Self {
        self.addr = addr;
        self
    }

    /// Binds port 0 on a fresh random loopback address `127.a.b.c`, like `launch` does.
    pub fn random_loopback(mut self) -> Result<Self> {
        self.addr = SocketAddr::new(crate::util::random_loopback_ip()?, 0);
        Ok(self)
    }

    /// Initial readiness of `/readyz` (default ready).
    pub fn ready(mut self, ready: bool) -> Self {
        self.ready = ready;
        self
    }

    /// Makes `/readyz` answer 200 only while `path` exists (and the server is ready: shutting
    /// down fails `/readyz` whatever the file says).
    pub fn ready_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ready_file = Some(path.into());
        self
    }

    /// Requires a client certificate signed by one of `roots` (https only).
    pub fn require_client_cert(mut self, roots: RootCertStore) -> Self {
        if let Protocol::Https { client_ca, .. } = &mut self.protocol {
            *client_ca = Some(roots);
        }
        self
    }

    /// Pause between `/watch` lines unless the request says `?interval_ms=N` (default 50ms).
    pub fn watch_interval(mut self, interval: Duration) -> Self {
        self.watch_interval = interval;
        self
    }

    /// Binds and starts serving in the current tokio runtime.
    pub async fn start(self) -> Result<FakeApiserver> {
        let listener = if self.reuse_port {
            let socket = socket2::Socket::new(
                socket2::Domain::for_address(self.addr),
                socket2::Type::STREAM,
                None,
            )?;
            socket.set_reuse_address(true)?;
            socket.set_reuse_port(true)?;
            socket.set_nonblocking(true)?;
            socket
                .bind(&self.addr.into())
                .with_context(|| format!("fake apiserver: bind {} (SO_REUSEPORT)", self.addr))?;
            socket.listen(1024)?;
            TcpListener::from_std(socket.into())?
        } else {
            TcpListener::bind(self.addr)
                .await
                .with_context(|| format!("fake apiserver: bind {}", self.addr))?
        };
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            ready: AtomicBool::new(self.ready),
            ready_file: self.ready_file,
            watch_interval: self.watch_interval,
            objects: Mutex::new(self.objects),
            revoked: Mutex::new(Vec::new()),
            rollout_time: self.rollout_time,
            never_ready: self.never_ready,
            rollouts: Mutex::new(HashMap::new()),
            bearer_token: self.bearer_token,
            accepted: AtomicU64::new(0),
            active: AtomicU64::new(0),
            active_sessions: AtomicU64::new(0),
            session_peers: Mutex::new(Vec::new()),
            active_watches: AtomicU64::new(0),
            eofs: AtomicU64::new(0),
            bytes_received: AtomicU64::new(0),
            requests: Mutex::new(HashMap::new()),
            connections: CancellationToken::new(),
            tracker: TaskTracker::new(),
        });
        let handler = match self.protocol {
            Protocol::Https {
                chain,
                key,
                client_ca,
            } => {
                let builder = rustls::ServerConfig::builder_with_provider(crypto_provider())
                    .with_safe_default_protocol_versions()?;
                let builder = match client_ca {
                    Some(roots) => builder.with_client_cert_verifier(
                        WebPkiClientVerifier::builder_with_provider(
                            Arc::new(roots),
                            crypto_provider(),
                        )
                        .build()
                        .context("client cert verifier")?,
                    ),
                    None => builder.with_no_client_auth(),
                };
                let mut config = builder
                    .with_single_cert(chain, key)
                    .context("serving certificate")?;
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                Handler::Https(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
            }
            Protocol::TcpEcho => Handler::Echo,
            Protocol::TcpSink => Handler::Sink,
        };
        let stop = CancellationToken::new();
        let accept_task =
            tokio::spawn(accept_loop(listener, handler, shared.clone(), stop.clone()));
        Ok(FakeApiserver {
            addr,
            shared,
            stop,
            accept_task: Mutex::new(Some(accept_task)),
        })
    }
}

/// A running fake apiserver; everything stops when it is dropped.
pub struct FakeApiserver {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: CancellationToken,
    accept_task: Mutex<Option<JoinHandle<()>>>,
}

impl FakeApiserver {
    /// An https fake serving `pki`'s serving certificate (SAN `kubernetes`, `localhost`).
    pub fn https(pki: &Pki) -> FakeApiserverBuilder {
        Self::https_with_identity(pki.server.cert_chain(), pki.server.private_key())
    }

    /// An https fake with an explicit certificate chain and key.
    pub fn https_with_identity(
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
    ) -> FakeApiserverBuilder {
        FakeApiserverBuilder::new(Protocol::Https {
            chain,
            key,
            client_ca: None,
        })
    }

    /// A raw TCP echo server.
    pub fn tcp_echo() -> FakeApiserverBuilder {
        FakeApiserverBuilder::new(Protocol::TcpEcho)
    }

    /// A raw TCP sink: reads to EOF, then answers `<bytes received>\n` and closes.
    pub fn tcp_sink() -> FakeApiserverBuilder {
        FakeApiserverBuilder::new(Protocol::TcpSink)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Switches `/readyz` between 200 and 503.
    pub fn set_ready(&self, ready: bool) {
        self.shared.ready.store(ready, Ordering::SeqCst);
    }

    /// What `/readyz` answers now.
    pub fn is_ready(&self) -> bool {
        self.shared.is_ready()
    }

    /// Closes the listening socket (new connects are refused) and keeps established
    /// connections. Returns once the socket is closed.
    pub async fn stop_listening(&self) {
        self.stop.cancel();
        let task = self.accept_task.lock().unwrap().take();
        if let Some(task) = task {
            let _ = task.await;
        }
    }

    /// Closes the listener and every established connection (a killed apiserver). Returns once
    /// all of them are closed.
    pub async fn vanish(&self) {
        self.stop_listening().await;
        self.shared.connections.cancel();
        self.shared.tracker.close();
        self.shared.tracker.wait().await;
    }

    /// TCP connections accepted so far (health checks included).
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// TCP connections open now (health checks included).
    pub fn active(&self) -> u64 {
        self.shared.active.load(Ordering::SeqCst)
    }

    /// Raw TCP modes: open connections that have received at least one byte. Unlike
    /// [`Self::active`] this leaves out `tcp` health checks, which send nothing.
    pub fn active_sessions(&self) -> u64 {
        self.shared.active_sessions.load(Ordering::SeqCst)
    }

    /// Raw TCP modes: peer addresses of the open data sessions (for a proxied connection, the
    /// proxy's local address of its backend-side socket).
    pub fn session_peers(&self) -> Vec<SocketAddr> {
        self.shared.session_peers.lock().unwrap().clone()
    }

    /// Raw TCP modes: data sessions (connections that sent at least one byte) on which EOF
    /// from the client was read; `tcp` health checks are left out.
    pub fn eofs(&self) -> u64 {
        self.shared.eofs.load(Ordering::SeqCst)
    }

    /// Raw TCP modes: bytes received over all connections.
    pub fn bytes_received(&self) -> u64 {
        self.shared.bytes_received.load(Ordering::SeqCst)
    }

    /// https: `/watch` streams open now.
    pub fn active_watches(&self) -> u64 {
        self.shared.active_watches.load(Ordering::SeqCst)
    }

    /// https: serves `json` at `GET path` from now on (added or replaced).
    pub fn set_object(&self, path: &str, json: &serde_json::Value) {
        self.shared
            .objects
            .lock()
            .unwrap()
            .insert(path.to_owned(), json.to_string());
    }

    /// https: `GET path` answers 404 from now on (a deleted object).
    pub fn remove_object(&self, path: &str) {
        self.shared.objects.lock().unwrap().remove(path);
    }

    /// https: requests presenting this client certificate get 401 on objects from now on.
    pub fn revoke_client_cert(&self, cert: &CertificateDer<'_>) {
        self.shared.revoked.lock().unwrap().push(cert.to_vec());
    }

    /// The object served at `path` now (after any `PUT`).
    pub fn object(&self, path: &str) -> Option<serde_json::Value> {
        let known = self.shared.objects.lock().unwrap().contains_key(path);
        known.then(|| serde_json::from_str(&self.shared.get(path)).expect("stored as JSON"))
    }

    /// Each method and path (without the query) requested so far, once, sorted.
    pub fn calls(&self) -> Vec<(String, String)> {
        let mut calls: Vec<_> = self
            .shared
            .requests
            .lock()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        calls.sort();
        calls
    }

    /// https: requests received for `path` (without query), by any method.
    pub fn requests(&self, path: &str) -> u64 {
        self.shared
            .requests
            .lock()
            .unwrap()
            .iter()
            .filter(|((_, p), _)| p == path)
            .map(|(_, n)| n)
            .sum()
    }
}

impl Drop for FakeApiserver {
    fn drop(&mut self) {
        self.stop.cancel();
        self.shared.connections.cancel();
    }
}

struct Shared {
    ready: AtomicBool,
    ready_file: Option<PathBuf>,
    watch_interval: Duration,
    /// Served at `GET path`; a `PUT` replaces them.
    objects: Mutex<HashMap<String, String>>,
    /// Client certificates (DER) answered 401.
    revoked: Mutex<Vec<Vec<u8>>>,
    rollout_time: Duration,
    /// A marker of Deployments whose rollout never completes, and their progress deadline.
    never_ready: Option<(String, Duration)>,
    /// Deployments put: when their rollout completes (`Ok`), or when it exceeds its progress
    /// deadline without ever completing (`Err`).
    rollouts: Mutex<HashMap<String, Result<std::time::Instant, std::time::Instant>>>,
    bearer_token: Option<String>,
    accepted: AtomicU64,
    active: AtomicU64,
    active_sessions: AtomicU64,
    /// Peer addresses of the open data sessions.
    session_peers: Mutex<Vec<SocketAddr>>,
    active_watches: AtomicU64,
    eofs: AtomicU64,
    bytes_received: AtomicU64,
    /// Requests by method and path (no query).
    requests: Mutex<HashMap<(String, String), u64>>,
    /// Cancelled by `vanish`: every connection task drops its socket.
    connections: CancellationToken,
    tracker: TaskTracker,
}

impl Shared {
    /// The object at `path`; a Deployment's status as its controller would report it.
    fn get(&self, path: &str) -> String {
        let text = self.objects.lock().unwrap()[path].clone();
        let Some(done) = self.rollouts.lock().unwrap().get(path).copied() else {
            return text;
        };
        let mut d: serde_json::Value = serde_json::from_str(&text).expect("stored as JSON");
        let replicas = d["spec"]["replicas"].as_i64().unwrap_or(1);
        let now = std::time::Instant::now();
        d["status"] = match done {
            Ok(done) if now >= done => {
                serde_json::json!({"observedGeneration": d["metadata"]["generation"], "replicas": replicas,
                    "updatedReplicas": replicas, "readyReplicas": replicas, "availableReplicas": replicas})
            }
            // The surge pod beside the old one, not ready (yet, or ever).
            _ => {
                let mut status = serde_json::json!({"observedGeneration": d["metadata"]["generation"],
                    "replicas": replicas + 1, "updatedReplicas": 1, "readyReplicas": replicas,
                    "availableReplicas": replicas, "unavailableReplicas": 1});
                if matches!(done, Err(deadline) if now >= deadline) {
                    status["conditions"] = serde_json::json!([{"type": "Progressing", "status": "False",
                        "reason": "ProgressDeadlineExceeded"}]);
                }
                status
            }
        };
        d.to_string()
    }

    /// Replaces the object at `path`; a Deployment gets its next generation and a rollout.
    fn put(&self, path: &str, mut object: serde_json::Value) -> String {
        let mut objects = self.objects.lock().unwrap();
        let old: serde_json::Value = serde_json::from_str(&objects[path]).expect("stored as JSON");
        if object["kind"] == "Deployment" || old["kind"] == "Deployment" {
            let generation = old["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
            object["metadata"]["generation"] = serde_json::json!(generation);
            let now = std::time::Instant::now();
            let done = match &self.never_ready {
                Some((marker, deadline)) if object.to_string().contains(marker.as_str()) => {
                    Err(now + *deadline)
                }
                _ => Ok(now + self.rollout_time),
            };
            self.rollouts.lock().unwrap().insert(path.to_owned(), done);
        }
        let text = object.to_string();
        objects.insert(path.to_owned(), text.clone());
        text
    }

    /// Ready while the flag is set (cleared at shutdown, as kube-apiserver's /readyz fails at
    /// SIGTERM) and, with a ready file, while that file exists.
    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst) && self.ready_file.as_ref().is_none_or(|p| p.exists())
    }
}

/// Decrements a gauge when dropped.
struct Gauge<'a>(&'a AtomicU64);

impl<'a> Gauge<'a> {
    fn inc(counter: &'a AtomicU64) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Clone)]
enum Handler {
    Https(tokio_rustls::TlsAcceptor),
    Echo,
    Sink,
}

async fn accept_loop(
    listener: TcpListener,
    handler: Handler,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            _ = stop.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            },
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let handler = handler.clone();
        shared.clone().tracker.spawn(async move {
            let _active = Gauge::inc(&shared.active);
            tokio::select! {
                _ = shared.connections.cancelled() => {}
                _ = serve(stream, handler, &shared) => {}
            }
        });
    }
    // The listener is dropped here: from now on connects are refused.
}

async fn serve(stream: TcpStream, handler: Handler, shared: &Arc<Shared>) {
    match handler {
        Handler::Https(acceptor) => {
            let Ok(Ok(tls)) =
                tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await
            else {
                return;
            };
            let peer = tls
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .map(|c| c.to_vec());
            let shared = shared.clone();
            let service = service_fn(move |request| handle(request, shared.clone(), peer.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(tls), service)
                .await;
        }
        Handler::Echo => {
            let _ = raw(stream, shared, false).await;
        }
        Handler::Sink => {
            let _ = raw(stream, shared, true).await;
        }
    }
}

/// Lists a session's peer in `session_peers` while it lives.
struct SessionPeer<'a>(&'a Shared, SocketAddr);

impl Drop for SessionPeer<'_> {
    fn drop(&mut self) {
        self.0
            .session_peers
            .lock()
            .unwrap()
            .retain(|p| *p != self.1);
    }
}

async fn raw(mut stream: TcpStream, shared: &Shared, sink: bool) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    let peer = stream.peer_addr()?;
    let mut session = None;
    let mut total = 0u64;
    loop {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            if session.is_some() {
                shared.eofs.fetch_add(1, Ordering::SeqCst);
            }
            break;
        }
        if session.is_none() {
            shared.session_peers.lock().unwrap().push(peer);
            session = Some((
                Gauge::inc(&shared.active_sessions),
                SessionPeer(shared, peer),
            ));
        }
        total += n as u64;
        shared.bytes_received.fetch_add(n as u64, Ordering::SeqCst);
        if !sink {
            stream.write_all(&buf[..n]).await?;
        }
    }
    if sink {
        stream.write_all(format!("{total}\n").as_bytes()).await?;
    }
    stream.shutdown().await
}

fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<ResponseBody> {
    Response::builder()
        .status(status)
        .header("content-type", "text/plain")
        .body(Full::new(body.into()).boxed_unsync())
        .expect("valid response")
}

fn query_u64(request: &Request<Incoming>, key: &str) -> Option<u64> {
    request.uri().query()?.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k == key).then(|| v.parse().ok()).flatten()
    })
}

async fn handle(
    request: Request<Incoming>,
    shared: Arc<Shared>,
    peer: Option<Vec<u8>>,
) -> Result<Response<ResponseBody>, Infallible> {
    let path = request.uri().path().to_owned();
    *shared
        .requests
        .lock()
        .unwrap()
        .entry((request.method().to_string(), path.clone()))
        .or_default() += 1;
    let response = match (request.method(), path.as_str()) {
        (&Method::GET, "/readyz") => {
            if shared.is_ready() {
                text(StatusCode::OK, "ok")
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "[-]fake-apiserver not ready\nreadyz check failed",
                )
            }
        }
        (&Method::GET, "/livez" | "/healthz") => text(StatusCode::OK, "ok"),
        (&Method::PUT, p) if shared.objects.lock().unwrap().contains_key(p) => {
            match request.into_body().collect().await.map(|b| b.to_bytes()) {
                Ok(body) => match serde_json::from_slice::<serde_json::Value>(&body) {
                    Ok(object) => text(StatusCode::OK, shared.put(p, object)),
                    Err(e) => text(StatusCode::BAD_REQUEST, format!("not JSON: {e}")),
                },
                Err(_) => text(StatusCode::BAD_REQUEST, "body error"),
            }
        }
        // A canned answer (etcd's JSON gateway answers every call with a POST).
        (&Method::POST, p) if shared.objects.lock().unwrap().contains_key(p) => Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(shared.get(p))).boxed_unsync())
            .expect("valid response"),
        (&Method::GET, p) if shared.objects.lock().unwrap().contains_key(p) => {
            let authorized = shared.bearer_token.as_ref().is_none_or(|token| {
                request
                    .headers()
                    .get(hyper::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok())
                    == Some(format!("Bearer {token}").as_str())
            }) && peer
                .as_ref()
                .is_none_or(|c| !shared.revoked.lock().unwrap().contains(c));
            if authorized {
                Response::builder()
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from(shared.get(p))).boxed_unsync())
                    .expect("valid response")
            } else {
                text(StatusCode::UNAUTHORIZED, "Unauthorized")
            }
        }
        (&Method::GET, "/version") => Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(VERSION_JSON.as_bytes())).boxed_unsync())
            .expect("valid response"),
        (&Method::POST, "/echo") => match request.into_body().collect().await {
            Ok(body) => text(StatusCode::OK, body.to_bytes()),
            Err(_) => text(StatusCode::BAD_REQUEST, "body error"),
        },
        (&Method::GET, "/slow") => {
            let ms = query_u64(&request, "ms").unwrap_or(200);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            text(StatusCode::OK, "slow done")
        }
        (&Method::GET, "/watch") => {
            let interval = query_u64(&request, "interval_ms")
                .map(Duration::from_millis)
                .unwrap_or(shared.watch_interval);
            watch(shared, interval)
        }
        _ => text(StatusCode::NOT_FOUND, "not found"),
    };
    Ok(response)
}

fn watch(shared: Arc<Shared>, interval: Duration) -> Response<ResponseBody> {
    let (tx, rx) = mpsc::channel::<Bytes>(1);
    shared.active_watches.fetch_add(1, Ordering::SeqCst);
    let body = WatchBody {
        rx,
        shared: shared.clone(),
    };
    tokio::spawn(async move {
        for n in 0u64.. {
            let line = Bytes::from(format!("{{\"type\":\"BOOKMARK\",\"n\":{n}}}\n"));
            if tx.send(line).await.is_err() {
                break;
            }
            tokio::select! {
                _ = tx.closed() => break,
                _ = tokio::time::sleep(interval) => {}
            }
        }
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(body.boxed_unsync())
        .expect("valid response")
}

/// The chunked `/watch` body: lines from a producer task; counts itself in `active_watches`.
struct WatchBody {
    rx: mpsc::Receiver<Bytes>,
    shared: Arc<Shared>,
}

impl Body for WatchBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.get_mut()
            .rx
            .poll_recv(cx)
            .map(|line| line.map(|line| Ok(Frame::data(line))))
    }
}

impl Drop for WatchBody {
    fn drop(&mut self) {
        self.shared.active_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{HttpsClient, TcpClient};
    use crate::util::{connection_refused, eventually};

    const DEADLINE: Duration = Duration::from_secs(5);

    #[tokio::test]
    async fn https_endpoints_and_readiness() {
        let pki = Pki::new().unwrap();
        let fake = FakeApiserver::https(&pki)
            .random_loopback()
            .unwrap()
            .start()
            .await
            .unwrap();
        let client = HttpsClient::new(pki.client_config(false).unwrap());
        let (status, body) = client.get(fake.addr(), "/readyz").await.unwrap();
        assert_eq!((status, body.as_str()), (200, "ok"));
        fake.set_ready(false);
        assert_eq!(client.get(fake.addr(), "/readyz").await.unwrap().0, 503);
        assert_eq!(client.get(fake.addr(), "/livez").await.unwrap().0, 200);
        let (status, body) = client.get(fake.addr(), "/version").await.unwrap();
        assert_eq!(status, 200);
        let version: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(version["gitVersion"], "v1.31.0-fake");
        let (status, body) = client
            .post(fake.addr(), "/echo", b"hello".to_vec())
            .await
            .unwrap();
        assert_eq!((status, body.as_str()), (200, "hello"));
        assert_eq!(fake.requests("/readyz"), 2);
    }

    #[tokio::test]
    async fn client_cert_required() {
        let pki = Pki::new().unwrap();
        let fake = FakeApiserver::https(&pki)
            .require_client_cert(pki.ca.root_store().unwrap())
            .start()
            .await
            .unwrap();
        let with = HttpsClient::new(pki.client_config(true).unwrap());
        assert_eq!(with.get(fake.addr(), "/version").await.unwrap().0, 200);
        let without = HttpsClient::new(pki.client_config(false).unwrap());
        assert!(without.get(fake.addr(), "/version").await.is_err());
    }

    #[tokio::test]
    async fn watch_streams_until_client_leaves() {
        let pki = Pki::new().unwrap();
        let fake = FakeApiserver::https(&pki).start().await.unwrap();
        let client = HttpsClient::new(pki.client_config(false).unwrap());
        let mut watch = client
            .watch(fake.addr(), "/watch?interval_ms=10")
            .await
            .unwrap();
        for _ in 0..3 {
            watch.next_line(DEADLINE).await.unwrap();
        }
        assert_eq!(fake.active_watches(), 1);
        drop(watch);
        eventually(DEADLINE, || async {
            anyhow::ensure!(fake.active_watches() == 0, "watch still open");
            Ok(())
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn stop_listening_keeps_connections_vanish_closes_them() {
        let fake = FakeApiserver::tcp_echo().start().await.unwrap();
        let mut conn = TcpClient::connect(fake.addr()).await.unwrap();
        conn.round_trip(b"ping").await.unwrap();
        assert_eq!(fake.active_sessions(), 1);
        assert_eq!(
            fake.session_peers(),
            vec![conn.stream().local_addr().unwrap()]
        );
        fake.stop_listening().await;
        assert!(connection_refused(fake.addr()).await);
        conn.round_trip(b"still there").await.unwrap();
        fake.vanish().await;
        assert_eq!(fake.active(), 0);
        assert!(conn.wait_closed(DEADLINE).await.is_ok());
    }

    #[tokio::test]
    async fn sink_counts_until_eof() {
        let fake = FakeApiserver::tcp_sink().start().await.unwrap();
        let mut conn = TcpClient::connect(fake.addr()).await.unwrap();
        conn.write_all(&[7u8; 100_000]).await.unwrap();
        conn.shutdown_write().await.unwrap();
        let answer = conn.read_to_end(DEADLINE).await.unwrap();
        assert_eq!(answer, b"100000\n");
        assert_eq!(fake.eofs(), 1);
    }

    #[tokio::test]
    async fn ready_file_controls_readyz() {
        let pki = Pki::new().unwrap();
        let file = pki.dir().join("ready");
        let fake = FakeApiserver::https(&pki)
            .ready_file(&file)
            .start()
            .await
            .unwrap();
        let client = HttpsClient::new(pki.client_config(false).unwrap());
        assert_eq!(client.get(fake.addr(), "/readyz").await.unwrap().0, 503);
        std::fs::write(&file, b"").unwrap();
        assert_eq!(client.get(fake.addr(), "/readyz").await.unwrap().0, 200);
        // Shutting down (SIGTERM in the binary) fails /readyz although the file is there.
        fake.set_ready(false);
        assert_eq!(client.get(fake.addr(), "/readyz").await.unwrap().0, 503);
    }
}
