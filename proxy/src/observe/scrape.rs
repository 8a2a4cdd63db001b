//! The node's scrape endpoint (`--metrics-listen`): one Prometheus target per node that stays
//! valid across rollouts.
//!
//! The pods of a rollout share the node's address (hostNetwork), and none may declare a port:
//! a declared port becomes a host port, and the scheduler would keep the surge pod off the
//! node. A scraper therefore cannot learn a per-pod port. Instead every instance on the node
//! binds the same `--metrics-listen` address with `SO_REUSEPORT`, and whichever accepts a
//! scrape answers with its own metrics **and those of every other live instance on the node**.
//! The answer is the same whoever gives it: every instance labels its series with
//! `--metrics-label` (`pod=…`). The endpoint serves `GET /metrics` only.
//!
//! The other instances' metrics come from a **peer-metrics listener** of each instance (a
//! loopback address of its own, port 0, `GET /metrics` only), published as
//! `<handoff-dir>/kap-<pid>-<n>.admin` (the directory every instance of the node already
//! shares, 0700, one uid); only loopback addresses are taken from there. Not from the admin
//! endpoint: that one answers the pod's probes, and no scrape may take a connection slot a
//! probe needs. The fan-out is cached for `--metrics-cache` (and concurrent scrapes wait for
//! the one fetch under way), so a scrape storm on the node address costs each other instance
//! one request per period.
//!
//! A peer that does not answer within [`FETCH_TIMEOUT`] is left out of that scrape; a file
//! whose address refuses connections is removed (its instance is gone: a live one writes its
//! file again within [`PUBLISH_INTERVAL`]). Responses close their connection, so a scraper
//! never keeps a connection to an instance that is about to exit. With
//! `--metrics-tls-cert-file` the node address speaks TLS and answers only scrapers with a
//! client certificate of `--metrics-client-ca-file`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{Empty, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use prometheus::{Encoder as _, TextEncoder};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Why the TLS of a scrape address cannot be set up: a flag missing, or a file.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("{flag}: {message}")]
    Missing {
        flag: &'static str,
        message: &'static str,
    },
    #[error("{flag} {path}: {source}")]
    File {
        flag: &'static str,
        path: String,
        #[source]
        source: crate::backends::tls::TlsError,
    },
}

/// The TLS of a scrape address (`run`'s `--metrics-listen`, `recover`'s) from
/// `--metrics-tls-cert-file`, `--metrics-tls-key-file` and `--metrics-client-ca-file`: all
/// three or none (TLS on a scrape address always authenticates the scraper).
pub fn tls_config(
    cert: Option<&PathBuf>,
    key: Option<&PathBuf>,
    ca: Option<&PathBuf>,
) -> Result<Option<Arc<rustls::ServerConfig>>, TlsConfigError> {
    use crate::backends::tls;
    let missing = |flag, message| Err(TlsConfigError::Missing { flag, message });
    let (cert, key, ca) = match (cert, key, ca) {
        (None, None, None) => return Ok(None),
        (Some(cert), Some(key), Some(ca)) => (cert, key, ca),
        (None, _, _) => {
            return missing(
                "--metrics-tls-cert-file",
                "missing (needed with --metrics-tls-key-file or --metrics-client-ca-file)",
            )
        }
        (_, None, _) => {
            return missing(
                "--metrics-tls-key-file",
                "missing (needed with --metrics-tls-cert-file)",
            )
        }
        (_, _, None) => {
            return missing(
                "--metrics-client-ca-file",
                "missing: TLS on --metrics-listen requires client certificates",
            )
        }
    };
    let file_err = |flag: &'static str, path: &PathBuf| {
        let path = path.display().to_string();
        move |source| TlsConfigError::File { flag, path, source }
    };
    let certs = tls::load_certs(cert).map_err(file_err("--metrics-tls-cert-file", cert))?;
    let key_der = tls::load_key(key).map_err(file_err("--metrics-tls-key-file", key))?;
    let roots = tls::load_roots(ca).map_err(file_err("--metrics-client-ca-file", ca))?;
    tls::server_config(certs, key_der, roots)
        .map(Some)
        .map_err(file_err("--metrics-tls-key-file", key))
}

use crate::base::http_client::{self, HttpError};
use crate::observe::admin::{self, AdminView};

/// How long a peer may take to answer its part of a scrape: well inside a scraper's own
/// timeout (Prometheus: 10s by default, at most the scrape interval), since a peer that is
/// exiting may still accept a connection it never answers.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(1);
/// How often an instance makes sure its admin address is published.
pub const PUBLISH_INTERVAL: Duration = Duration::from_secs(10);
/// How often a bind of `--metrics-listen` that failed is tried again.
pub const BIND_RETRY: Duration = Duration::from_secs(5);
/// Largest peer answer taken into a scrape.
const MAX_PEER_BODY: usize = 4 << 20;

/// Where the instances of a node find each other's admin endpoints.
#[derive(Debug, Clone)]
pub struct Peers {
    /// The shared directory (`--handoff-dir`).
    pub dir: PathBuf,
    /// Our own entry's file name, `kap-<pid>-<n>.admin`.
    pub own: String,
}

impl Peers {
    /// A fresh entry name for this process in `dir`.
    pub fn new(dir: PathBuf) -> Self {
        let own = format!(
            "kap-{}-{:08x}.admin",
            std::process::id(),
            rand::random::<u32>()
        );
        Self { dir, own }
    }

    /// The peer-metrics addresses the other instances published (loopback only), with their
    /// files. Blocking.
    fn list(&self) -> Vec<(PathBuf, SocketAddr)> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for entry in entries.filter_map(|e| e.ok()) {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name == self.own || !name.starts_with("kap-") || !name.ends_with(".admin") {
                continue;
            }
            // Only small regular files: a FIFO would block the read.
            let Ok(meta) = entry.metadata() else { continue };
            if !meta.is_file() || meta.len() > 256 {
                continue;
            }
            let addr = std::fs::read_to_string(entry.path())
                .ok()
                .and_then(|t| t.trim().parse::<SocketAddr>().ok())
                .filter(|a| a.ip().is_loopback());
            if let Some(addr) = addr {
                out.push((entry.path(), addr));
            }
        }
        out.sort();
        out
    }
}

/// Publishes our peer-metrics address until `stop`, then removes it. Writes it again whenever it is
/// missing (a peer removed it while we could not answer, or someone cleaned the directory).
pub async fn publish(peers: Peers, peer_addr: SocketAddr, stop: CancellationToken) {
    let path = peers.dir.join(&peers.own);
    loop {
        let file = path.clone();
        let written = tokio::task::spawn_blocking(move || {
            if file.exists() {
                return Ok(());
            }
            crate::base::fsutil::write_atomic(&file, format!("{peer_addr}\n").as_bytes())
        })
        .await;
        if let Ok(Err(e)) = written {
            tracing::warn!(file = %path.display(), error = %e, "cannot publish the peer-metrics address for --metrics-listen");
        }
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = tokio::time::sleep(PUBLISH_INTERVAL) => {}
        }
    }
    let remove = tokio::task::spawn_blocking(move || std::fs::remove_file(path));
    let _ = tokio::time::timeout(Duration::from_secs(1), remove).await;
}

/// Serves this instance's own metrics to the other instances of the node, on `listener` (the
/// address [`publish`]ed), until `stop`. `GET /metrics` only, with a connection budget of its
/// own.
pub async fn serve_peer(
    listener: tokio::net::TcpListener,
    view: Arc<AdminView>,
    stop: CancellationToken,
    tasks: TaskTracker,
) {
    let handler = move |req: Request<Incoming>| {
        let view = view.clone();
        async move {
            if req.uri().path() != "/metrics" {
                return admin::text(StatusCode::NOT_FOUND, "not found: only /metrics here\n");
            }
            if req.method() != Method::GET && req.method() != Method::HEAD {
                return admin::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
            }
            view.metrics_response().await
        }
    };
    admin::serve_with(listener, handler, false, None, stop, tasks).await;
}

/// How the node's scrape address is served.
pub struct NodeScrape {
    /// `--metrics-listen`.
    pub addr: SocketAddr,
    /// Where the other instances are found.
    pub peers: Peers,
    /// How long fetched peer metrics are reused (`--metrics-cache`).
    pub cache_for: Duration,
    /// TLS with client certificates, if configured.
    pub tls: Option<Arc<rustls::ServerConfig>>,
}

/// Published peers, as [`Peers::list`] gives them.
type PeerList = Vec<(PathBuf, SocketAddr)>;

/// The last fan-out: when, to which peers, and their texts.
struct Fetched {
    at: Instant,
    peers: PeerList,
    texts: Arc<Vec<String>>,
}

/// The other instances' metrics of the last fan-out, reused until they are `cache_for` old or
/// the published peers change (an instance started or went away: the next scrape shows it at
/// once).
struct PeerCache {
    peers: Peers,
    cache_for: Duration,
    /// Held across a fetch, so concurrent scrapes wait for the one fetch under way instead of
    /// starting their own.
    last: tokio::sync::Mutex<Option<Fetched>>,
}

impl PeerCache {
    async fn get(&self) -> Arc<Vec<String>> {
        let mut last = self.last.lock().await;
        let list = {
            let peers = self.peers.clone();
            tokio::task::spawn_blocking(move || peers.list())
                .await
                .unwrap_or_default()
        };
        if let Some(f) = last.as_ref() {
            if f.at.elapsed() < self.cache_for && f.peers == list {
                return f.texts.clone();
            }
        }
        let texts = Arc::new(fetch_all(list.clone()).await);
        *last = Some(Fetched {
            at: Instant::now(),
            peers: list,
            texts: texts.clone(),
        });
        texts
    }
}

/// Binds `scrape.addr` with `SO_REUSEPORT` (trying again every [`BIND_RETRY`] while it fails:
/// the proxy's own work never depends on it) and serves the node's metrics there until `stop`.
pub async fn serve(
    scrape: NodeScrape,
    view: Arc<AdminView>,
    stop: CancellationToken,
    tasks: TaskTracker,
) {
    let addr = scrape.addr;
    let mut warned = false;
    let listener = loop {
        match crate::base::net::bind_reuseport(addr).and_then(tokio::net::TcpListener::from_std) {
            Ok(l) => break l,
            Err(e) => {
                if !warned {
                    tracing::warn!(addr = %addr, error = %e, "cannot bind --metrics-listen; trying again every 5s");
                    warned = true;
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(BIND_RETRY) => {}
        }
    };
    tracing::info!(addr = %addr, tls = scrape.tls.is_some(), "node metrics endpoint listening");
    let cache = Arc::new(PeerCache {
        peers: scrape.peers,
        cache_for: scrape.cache_for,
        last: tokio::sync::Mutex::new(None),
    });
    let handler = move |req: Request<Incoming>| {
        let (view, cache) = (view.clone(), cache.clone());
        async move { respond(&req, &view, &cache).await }
    };
    // No keep-alive: each scrape connects anew and lands on any live instance (all answer
    // the same), never on a kept connection to an instance that is about to exit.
    admin::serve_with(listener, handler, false, scrape.tls, stop, tasks).await;
}

async fn respond(
    req: &Request<Incoming>,
    view: &AdminView,
    cache: &PeerCache,
) -> Response<Full<Bytes>> {
    if req.uri().path() != "/metrics" {
        return admin::text(StatusCode::NOT_FOUND, "not found: only /metrics here\n");
    }
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return admin::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    }
    let own = match view.metrics_text().await {
        Ok(text) => String::from_utf8_lossy(&text).into_owned(),
        Err(_) => return admin::text(StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n"),
    };
    let peers = cache.get().await;
    let mut texts = Vec::with_capacity(peers.len() + 1);
    texts.push(own);
    texts.extend(peers.iter().cloned());
    Response::builder()
        .header(
            hyper::header::CONTENT_TYPE,
            TextEncoder::new().format_type(),
        )
        .body(Full::new(Bytes::from(merge(&texts))))
        .expect("valid response")
}

/// Fetches the metrics of every instance in `list`, in parallel; removes the files of gone
/// instances.
async fn fetch_all(list: PeerList) -> Vec<String> {
    let mut fetches = tokio::task::JoinSet::new();
    for (file, addr) in list {
        fetches.spawn(async move { (file, addr, fetch(addr).await) });
    }
    let mut texts = Vec::new();
    while let Some(joined) = fetches.join_next().await {
        let Ok((file, addr, result)) = joined else {
            continue;
        };
        match result {
            Ok(text) => texts.push(text),
            Err(e) if e.is_refused() => {
                // Nobody listens there any more: the instance is gone without removing its file.
                tracing::info!(peer = %addr, file = %file.display(), "removing the peer-metrics address of a gone instance");
                let _ = tokio::task::spawn_blocking(move || std::fs::remove_file(file)).await;
            }
            Err(e) => {
                tracing::debug!(peer = %addr, error = %e, "peer metrics left out of this scrape");
            }
        }
    }
    texts
}

/// Why a peer's metrics could not be fetched.
#[derive(Debug, thiserror::Error)]
enum FetchError {
    #[error(transparent)]
    Http(#[from] HttpError),
    #[error("not UTF-8: {0}")]
    NotUtf8(#[from] std::string::FromUtf8Error),
}

impl FetchError {
    /// Connection refused: nobody listens on its address any more.
    fn is_refused(&self) -> bool {
        matches!(self, FetchError::Http(e) if e.is_refused())
    }
}

/// `GET /metrics` from a peer's peer-metrics listener.
async fn fetch(addr: SocketAddr) -> Result<String, FetchError> {
    let work = async {
        let tcp = http_client::connect(addr).await?;
        let req = Request::get("/metrics")
            .header(hyper::header::HOST, addr.to_string())
            .body(Empty::<Bytes>::new())?;
        http_client::request(tcp, req, MAX_PEER_BODY)
            .await?
            .accept(|s| s == StatusCode::OK, 0)
    };
    let body = http_client::within(FETCH_TIMEOUT, work).await?;
    Ok(String::from_utf8(body.to_vec())?)
}

/// One metric family of a text exposition: its `# HELP` and `# TYPE` lines and its samples.
#[derive(Default)]
struct Family {
    help: Option<String>,
    kind: Option<String>,
    samples: Vec<String>,
}

/// The family `name`, added (and remembered in `order`) the first time it is seen.
fn family_entry<'a>(
    families: &'a mut BTreeMap<String, Family>,
    order: &mut Vec<String>,
    name: &str,
) -> &'a mut Family {
    families.entry(name.to_owned()).or_insert_with(|| {
        order.push(name.to_owned());
        Family::default()
    })
}

/// Merges Prometheus text expositions into one: every family once, with its `# HELP` and
/// `# TYPE` from the first exposition that has them, followed by the samples of all of them
/// (the text format wants each family's lines together). Samples of a family whose type
/// differs between expositions (another version of the proxy) are left out rather than
/// mistyped. Only `kube_apiserver_proxy_` families are taken. Pure.
pub fn merge(texts: &[String]) -> String {
    let mut order: Vec<String> = Vec::new();
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    for text in texts {
        // The family the following samples belong to, and whether its type agrees.
        let mut current: Option<(String, bool)> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
                if !name.starts_with(crate::base::metrics::PREFIX) {
                    current = None;
                    continue;
                }
                let family = family_entry(&mut families, &mut order, name);
                family.help.get_or_insert_with(|| help.to_owned());
                current = Some((name.to_owned(), true));
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
                if !name.starts_with(crate::base::metrics::PREFIX) {
                    current = None;
                    continue;
                }
                let family = family_entry(&mut families, &mut order, name);
                let agrees = family.kind.get_or_insert_with(|| kind.to_owned()) == kind;
                current = Some((name.to_owned(), agrees));
            } else if line.starts_with('#') || line.trim().is_empty() {
                continue;
            } else if let Some((name, true)) = &current {
                let sample_name = line.split(['{', ' ']).next().unwrap_or("");
                if sample_name.starts_with(name.as_str()) {
                    if let Some(family) = families.get_mut(name) {
                        family.samples.push(line.to_owned());
                    }
                }
            }
        }
    }
    let mut out = String::new();
    for name in order {
        let family = &families[&name];
        if let Some(help) = &family.help {
            out.push_str(&format!("# HELP {name} {help}\n"));
        }
        if let Some(kind) = &family.kind {
            out.push_str(&format!("# TYPE {name} {kind}\n"));
        }
        for sample in &family.samples {
            out.push_str(sample);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str =
        "# HELP kube_apiserver_proxy_connections_accepted_total Client connections accepted.
# TYPE kube_apiserver_proxy_connections_accepted_total counter
kube_apiserver_proxy_connections_accepted_total{pod=\"a\"} 3
# HELP kube_apiserver_proxy_backend_connect_duration_seconds Time to connect to the backend.
# TYPE kube_apiserver_proxy_backend_connect_duration_seconds histogram
kube_apiserver_proxy_backend_connect_duration_seconds_bucket{backend=\"x\",pod=\"a\",le=\"+Inf\"} 1
kube_apiserver_proxy_backend_connect_duration_seconds_sum{backend=\"x\",pod=\"a\"} 0.001
kube_apiserver_proxy_backend_connect_duration_seconds_count{backend=\"x\",pod=\"a\"} 1
";

    const B: &str =
        "# HELP kube_apiserver_proxy_connections_accepted_total Client connections accepted.
# TYPE kube_apiserver_proxy_connections_accepted_total counter
kube_apiserver_proxy_connections_accepted_total{pod=\"b\"} 5
# HELP kube_apiserver_proxy_new_total Only in a newer version.
# TYPE kube_apiserver_proxy_new_total counter
kube_apiserver_proxy_new_total{pod=\"b\"} 1
# HELP other_metric Not ours.
# TYPE other_metric gauge
other_metric 1
";

    #[test]
    fn families_are_merged_once_with_every_instances_samples() {
        let merged = merge(&[A.to_owned(), B.to_owned()]);
        let type_lines = merged
            .lines()
            .filter(|l| l.starts_with("# TYPE kube_apiserver_proxy_connections_accepted_total"))
            .count();
        assert_eq!(type_lines, 1, "{merged}");
        let accepted: Vec<&str> = merged
            .lines()
            .filter(|l| l.starts_with("kube_apiserver_proxy_connections_accepted_total{"))
            .collect();
        assert_eq!(accepted.len(), 2, "{merged}");
        // The family's lines stay together: the samples follow their TYPE line directly.
        let lines: Vec<&str> = merged.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.starts_with("# TYPE kube_apiserver_proxy_connections_accepted_total"))
            .unwrap();
        assert!(
            lines[at + 1].ends_with(" 3") && lines[at + 2].ends_with(" 5"),
            "{merged}"
        );
        assert!(merged.contains("_bucket{backend=\"x\",pod=\"a\",le=\"+Inf\"} 1"));
        assert!(merged.contains("kube_apiserver_proxy_new_total{pod=\"b\"} 1"));
        assert!(!merged.contains("other_metric"), "{merged}");
    }

    #[test]
    fn a_family_typed_differently_elsewhere_keeps_the_first_type_only() {
        let changed = A.replace(
            "connections_accepted_total counter",
            "connections_accepted_total gauge",
        );
        let merged = merge(&[B.to_owned(), changed]);
        assert!(merged.contains("# TYPE kube_apiserver_proxy_connections_accepted_total counter"));
        assert!(!merged.contains("{pod=\"a\"} 3"), "{merged}");
        assert!(merged.contains("{pod=\"b\"} 5"));
    }

    #[test]
    fn peers_lists_other_admin_files_only() {
        let dir = std::env::temp_dir().join(format!("kap-scrape-{}", rand::random::<u32>()));
        std::fs::create_dir(&dir).unwrap();
        let peers = Peers::new(dir.clone());
        std::fs::write(dir.join(&peers.own), "127.0.0.1:1\n").unwrap();
        std::fs::write(dir.join("kap-7-00000001.admin"), "127.0.0.1:2\n").unwrap();
        std::fs::write(dir.join("kap-7-00000002.sock"), "not an admin entry").unwrap();
        std::fs::write(dir.join("kap-8-00000003.admin"), "garbage").unwrap();
        let seen: Vec<SocketAddr> = peers.list().into_iter().map(|(_, a)| a).collect();
        assert_eq!(seen, ["127.0.0.1:2".parse::<SocketAddr>().unwrap()]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
