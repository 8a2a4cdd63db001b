//! `kube-apiserver-proxy recover`: the node agent that keeps the last-known-good checkpoint,
//! brings it back after a reboot and takes it away once the Deployment serves again.
//!
//! It runs as a permanent static pod (manifests/node/kube-apiserver-recovery.yaml), as root
//! with only `CAP_DAC_OVERRIDE`, because it is the one process allowed to write the kubelet's
//! static pod directory. It does three things:
//!
//! - **Checkpoint** ([`crate::node::recovery::checkpoint`]), every `--checkpoint-interval` while an apiserver
//!   answers: the newest pod of the Deployment on this node that has been Ready for
//!   `--checkpoint-after` is written to the checkpoint directory, read with the node's own
//!   identity (`--kubeconfig`), if it belongs to `--workload` and passes the rules of the boot
//!   ([`staticpod::Policy`]); otherwise the previous checkpoint stays and the refusal is logged
//!   and counted (`--metrics-listen`).
//! - **Activate, once per boot.** At its first start after a boot (no `--boot-marker` in the
//!   node's `/run`, a tmpfs), if a checkpoint exists, passes [`staticpod::validate`] again and
//!   nothing accepts connections on `--node-address`, it copies the checkpoint into the static
//!   pod directory as `kube-apiserver-checkpoint.json`; the kubelet starts it at once (it
//!   watches the directory). Then it writes the marker, so a restart of the kubelet or of this
//!   pod never activates again. A checkpoint left active from before the reboot stays active.
//! - **Deactivate, when asked.** The recovery instance's proxy writes `--retire-file` once an
//!   instance of the Deployment is ready beside it ([`crate::instance::retire`]); the agent then removes
//!   the manifest from the static pod directory (the kubelet stops the pod: its proxy hands the
//!   listening socket to that instance) and the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::node::kubeconfig::KubeconfigError;
use crate::node::object::Pod;
use crate::node::recovery::checkpoint_metrics::CheckpointMetrics;
use crate::node::recovery::staticpod;

/// Why `recover` cannot start or stopped: bad flags or files (exit 2, see
/// [`CommandError::is_bad_input`](crate::base::exit::CommandError::is_bad_input)) or a failure at run time (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum RecoverError {
    #[error("--node-address: {0}")]
    NodeAddress(crate::cli::ParseError),
    #[error("--static-pod-dir {0}: not a directory")]
    StaticPodDir(String),
    #[error("--interval: must be greater than zero")]
    Interval,
    #[error("--checkpoint-interval and --checkpoint-after: must be greater than zero")]
    CheckpointTiming,
    /// `--kubeconfig` as [`KubeconfigError`] names it: `--kubeconfig PATH: problem`.
    #[error("--{0}")]
    Kubeconfig(#[source] KubeconfigError),
    #[error("--workload: {0}")]
    Workload(crate::node::recovery::checkpoint::WorkloadError),
    #[error("--allow-host-path {0}: not a plain absolute path")]
    HostPath(String),
    #[error("--allow-image-repository {0:?}: give a repository without tag or digest")]
    ImageRepository(String),
    #[error("--metrics-listen: {0}")]
    MetricsListen(crate::cli::ParseError),
    /// The TLS of --metrics-listen, as `run`'s: `--FLAG FILE: problem`.
    #[error("{0}")]
    MetricsTls(#[source] crate::observe::scrape::TlsConfigError),
    #[error("--metrics-listen: bind {addr}: {source}")]
    MetricsBind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start: {0}")]
    Runtime(#[source] std::io::Error),
}

impl crate::base::exit::CommandError for RecoverError {
    /// Bad flags or files (exit 2) rather than a failure at run time (exit 1).
    fn is_bad_input(&self) -> bool {
        match self {
            RecoverError::NodeAddress(_)
            | RecoverError::StaticPodDir(_)
            | RecoverError::Interval
            | RecoverError::CheckpointTiming
            | RecoverError::Kubeconfig(_)
            | RecoverError::Workload(_)
            | RecoverError::HostPath(_)
            | RecoverError::ImageRepository(_)
            | RecoverError::MetricsListen(_)
            | RecoverError::MetricsTls(_) => true,
            RecoverError::MetricsBind { .. } | RecoverError::Runtime(_) => false,
        }
    }
}

/// The static pod's file name in the kubelet's directory.
pub fn manifest_name() -> String {
    format!("{}.json", staticpod::NAME)
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct Recover {
    pub checkpoint: PathBuf,
    pub checkpoint_dir: PathBuf,
    /// The checkpoint writer (with `--kubeconfig`).
    pub writer: Option<crate::node::recovery::checkpoint::WriterConfig>,
    pub checkpoint_interval: Duration,
    pub static_pod_dir: PathBuf,
    pub retire_file: PathBuf,
    pub boot_marker: PathBuf,
    pub node_address: SocketAddr,
    /// What a checkpoint may hold, at writing and at activation.
    pub policy: staticpod::Policy,
    pub metrics_listen: Option<SocketAddr>,
    /// kubeadm's apiserver manifest, for the version check at boot (`--kubeadm-manifest`),
    /// unless `--allow-version-skew`.
    pub kubeadm_manifest: Option<PathBuf>,
    /// TLS on `metrics_listen` (with client certificates), as `run`'s scrape address.
    pub metrics_tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    pub interval: Duration,
}

/// What `recover` is asked for (its flags, `cli::RecoverArgs`; the log format is the binary's).
#[derive(Debug, Clone)]
pub struct Options {
    /// The node address the apiserver serves (NODE_IP:6443): the checkpoint is activated only
    /// when nothing accepts connections there.
    pub node_address: String,

    /// The checkpoint directory (persistent, root-only): `kube-apiserver.json`, the
    /// checkpoint, and `kube-apiserver.previous.json`, the one it replaced.
    pub checkpoint_dir: PathBuf,

    /// The node's kubeconfig (the kubelet's: /etc/kubernetes/kubelet.conf): the identity the
    /// apiserver pods bound to this node are read with, to write the checkpoint. Without it
    /// no checkpoint is written (activation and retirement only).
    pub kubeconfig: Option<PathBuf>,

    /// This node's name (the pods bound to it are read).
    pub node_name: Option<String>,

    /// Namespace of the apiserver Deployment.
    pub namespace: String,

    /// Label selector of the apiserver workload's pods (mirror pods are left out).
    pub selector: String,

    /// How long a pod must have been Ready, without a break, before it becomes the checkpoint.
    pub checkpoint_after: Duration,

    /// How often the pods are read.
    pub checkpoint_interval: Duration,

    /// The kubelet's static pod directory (`staticPodPath`).
    pub static_pod_dir: PathBuf,

    /// Written by the recovery instance's proxy (`run --retire-file`) when it may go.
    pub retire_file: PathBuf,

    /// Marks that this boot's decision was made; must be on a tmpfs (/run) so that a reboot
    /// clears it.
    pub boot_marker: PathBuf,

    /// The workload whose pods may become the checkpoint: deployment/NAME or daemonset/NAME in
    /// --namespace. A pod is written only if its controller owner references lead there (read
    /// from the API: the node's identity needs `get` on them, manifests/recovery).
    pub workload: String,

    /// A further host path a checkpoint may mount, ADDED to the defaults (repeatable): kubeadm's
    /// certificate directories (/etc/kubernetes/pki, /etc/ssl/certs, /etc/ca-certificates,
    /// /etc/pki, /usr/share/ca-certificates, /usr/local/share/ca-certificates) and
    /// /run/kube-apiserver-proxy. Never allowed, whatever is given here: the checkpoint
    /// directory, the static pod directory, kubeadm's /etc/kubernetes/manifests, and any
    /// directory above one.
    pub allow_host_path: Vec<String>,

    /// A further image repository a checkpoint's containers may run (repeatable, without tag),
    /// ADDED to the default registry.k8s.io/kube-apiserver: give the proxy's repository, and
    /// your mirror's. An entry ending in / allows every repository below it.
    pub allow_image_repository: Vec<String>,

    /// A capability a checkpoint's container may add (repeatable; none by default: a pod that
    /// adds any is refused). Only for a Deployment that needs one, e.g. transparent client
    /// addresses (NET_RAW, SETUID, SETGID for its sidecar).
    pub allow_capability: Vec<String>,

    /// kubeadm's apiserver manifest: at boot a checkpoint more than one minor version behind
    /// its image is not activated (the apiserver would meet data and clients of a newer one).
    /// Absent or unreadable: no such check (logged).
    pub kubeadm_manifest: PathBuf,

    /// Activate a checkpoint whatever its version is behind --kubeadm-manifest's.
    pub allow_version_skew: bool,

    /// Serve the agent's metrics (checkpoint age and refusals) on ADDR at /metrics.
    pub metrics_listen: Option<String>,

    /// Serve --metrics-listen over TLS with this certificate (PEM); needs --metrics-tls-key-file and --metrics-client-ca-file (as `run`'s).
    pub metrics_tls_cert_file: Option<PathBuf>,

    /// The private key of --metrics-tls-cert-file (PEM).
    pub metrics_tls_key_file: Option<PathBuf>,

    /// With TLS on --metrics-listen: only scrapers presenting a client certificate issued by a CA of this PEM file are answered.
    pub metrics_client_ca_file: Option<PathBuf>,

    /// How often the retire file is looked for.
    pub interval: Duration,
}

impl TryFrom<&Options> for Recover {
    type Error = RecoverError;

    fn try_from(args: &Options) -> Result<Self, RecoverError> {
        let node_address =
            crate::cli::parse_socket_addr(&args.node_address).map_err(RecoverError::NodeAddress)?;
        if !args.static_pod_dir.is_dir() {
            return Err(RecoverError::StaticPodDir(
                args.static_pod_dir.display().to_string(),
            ));
        }
        if args.interval.is_zero() {
            return Err(RecoverError::Interval);
        }
        if args.checkpoint_interval.is_zero() || args.checkpoint_after.is_zero() {
            return Err(RecoverError::CheckpointTiming);
        }
        for path in &args.allow_host_path {
            if staticpod::normalize(path).is_none() {
                return Err(RecoverError::HostPath(path.clone()));
            }
        }
        for repo in &args.allow_image_repository {
            if repo.is_empty() || staticpod::image_repository(repo) != repo {
                return Err(RecoverError::ImageRepository(repo.clone()));
            }
        }
        // A pod that can write the checkpoint or the static pod directory can make any pod a
        // static pod: no checkpoint may mount either, nor a directory above them; nor kubeadm's
        // manifest directory, which `kubeadm-sync` copies into the kubelet's.
        let mut protected = [&args.checkpoint_dir, &args.static_pod_dir]
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>();
        protected.push(staticpod::KUBEADM_MANIFESTS.to_owned());
        let policy = staticpod::Policy::new(
            &args.allow_host_path,
            &args.allow_image_repository,
            &protected,
        )
        .allow_capabilities(&args.allow_capability);
        let workload: crate::node::recovery::checkpoint::Workload =
            args.workload.parse().map_err(RecoverError::Workload)?;
        let metrics_listen = args
            .metrics_listen
            .as_deref()
            .map(crate::cli::parse_socket_addr)
            .transpose()
            .map_err(RecoverError::MetricsListen)?;
        let metrics_tls = crate::observe::scrape::tls_config(
            args.metrics_tls_cert_file.as_ref(),
            args.metrics_tls_key_file.as_ref(),
            args.metrics_client_ca_file.as_ref(),
        )
        .map_err(RecoverError::MetricsTls)?;
        let writer = match (&args.kubeconfig, &args.node_name) {
            (Some(kubeconfig), Some(node)) => {
                // Read now to refuse a bad one at start; read again at every attempt.
                crate::node::api::ApiClient::from_kubeconfig(kubeconfig)
                    .map_err(RecoverError::Kubeconfig)?;
                Some(crate::node::recovery::checkpoint::WriterConfig {
                    dir: args.checkpoint_dir.clone(),
                    namespace: args.namespace.clone(),
                    selector: args.selector.clone(),
                    workload,
                    node: node.clone(),
                    after: args.checkpoint_after,
                    retire_file: args.retire_file.display().to_string(),
                    kubeconfig: kubeconfig.clone(),
                    policy: policy.clone(),
                })
            }
            _ => None,
        };
        Ok(Recover {
            checkpoint: args
                .checkpoint_dir
                .join(crate::node::recovery::checkpoint::FILE),
            checkpoint_dir: args.checkpoint_dir.clone(),
            writer,
            checkpoint_interval: args.checkpoint_interval,
            static_pod_dir: args.static_pod_dir.clone(),
            retire_file: args.retire_file.clone(),
            boot_marker: args.boot_marker.clone(),
            node_address,
            policy,
            metrics_listen,
            kubeadm_manifest: (!args.allow_version_skew).then(|| args.kubeadm_manifest.clone()),
            metrics_tls,
            interval: args.interval,
        })
    }
}

/// What the boot-time decision came to (also written into the marker).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// The checkpoint of this pod is now in the static pod directory.
    Activated(String),
    /// The manifest was already there (the node went down while recovering).
    AlreadyActive,
    /// Not activated, and why.
    Not(String),
}

/// Runs the agent until SIGTERM or SIGINT.
pub fn run(args: &Options) -> Result<(), RecoverError> {
    let config = Recover::try_from(args)?;
    let runtime = crate::base::runtime::current_thread().map_err(RecoverError::Runtime)?;
    runtime.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(RecoverError::Runtime)?;
        let registry = prometheus::Registry::new();
        let metrics = CheckpointMetrics::new(&registry);
        let stop = tokio_util::sync::CancellationToken::new();
        let tasks = tokio_util::task::TaskTracker::new();
        if let Some(addr) = config.metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| RecoverError::MetricsBind { addr, source })?;
            tasks.spawn(serve_metrics(
                listener,
                registry,
                config.metrics_tls.clone(),
                stop.clone(),
                tasks.clone(),
            ));
        }
        tracing::info!(checkpoint = %config.checkpoint.display(), static_pod_dir = %config.static_pod_dir.display(), node_address = %config.node_address, metrics_listen = ?config.metrics_listen, "recover: started");
        metrics
            .written
            .set(unix_seconds(crate::node::recovery::checkpoint::written_at(&config.checkpoint_dir)));
        boot(&config).await;
        let mut writer = Writer::new(metrics.clone());
        let mut next_checkpoint = tokio::time::Instant::now();
        loop {
            metrics
                .active
                .set(i64::from(config.static_pod_dir.join(manifest_name()).exists()));
            tokio::select! {
                _ = term.recv() => break,
                _ = tokio::signal::ctrl_c() => break,
                _ = tokio::time::sleep(config.interval) => {}
            }
            retire(&config);
            if let Some(w) = &config.writer {
                if tokio::time::Instant::now() >= next_checkpoint {
                    writer.attempt(w).await;
                    next_checkpoint = tokio::time::Instant::now() + config.checkpoint_interval;
                }
            }
        }
        tracing::info!("recover: stopping");
        stop.cancel();
        tasks.close();
        let _ = tokio::time::timeout(Duration::from_secs(1), tasks.wait()).await;
        Ok(())
    })
}

/// Serves `GET /metrics` of the agent's registry until `stop`.
async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: prometheus::Registry,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    stop: tokio_util::sync::CancellationToken,
    tasks: tokio_util::task::TaskTracker,
) {
    use prometheus::Encoder as _;
    let handler = move |req: hyper::Request<hyper::body::Incoming>| {
        let registry = registry.clone();
        async move {
            if req.method() != hyper::Method::GET || req.uri().path() != "/metrics" {
                return crate::observe::admin::text(hyper::StatusCode::NOT_FOUND, "not found\n");
            }
            let mut body = Vec::new();
            let encoder = prometheus::TextEncoder::new();
            if let Err(e) = encoder.encode(&registry.gather(), &mut body) {
                return crate::observe::admin::text(
                    hyper::StatusCode::INTERNAL_SERVER_ERROR,
                    &format!("{e}\n"),
                );
            }
            hyper::Response::builder()
                .header(hyper::header::CONTENT_TYPE, encoder.format_type())
                .body(http_body_util::Full::new(hyper::body::Bytes::from(body)))
                .expect("valid response")
        }
    };
    crate::observe::admin::serve_with(listener, handler, false, tls, stop, tasks).await;
}

fn unix_seconds(t: Option<std::time::SystemTime>) -> i64 {
    t.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_secs() as i64)
}

/// The once-per-boot decision; writes the marker.
pub async fn boot(config: &Recover) -> Option<Decision> {
    if config.boot_marker.exists() {
        tracing::info!(marker = %config.boot_marker.display(), "recover: not the first start since boot; nothing to activate");
        return None;
    }
    let decision = decide(config).await;
    match &decision {
        Decision::Activated(of) => {
            tracing::info!(of, manifest = %config.static_pod_dir.join(manifest_name()).display(), "recover: checkpoint activated: the kubelet runs it as a static pod until an instance of the Deployment is ready")
        }
        Decision::AlreadyActive => {
            tracing::info!("recover: checkpoint already active (the node went down while recovering); it stays until retired")
        }
        Decision::Not(why) => tracing::warn!(reason = %why, "recover: checkpoint not activated"),
    }
    let text = match &decision {
        Decision::Activated(of) => format!("activated {of}\n"),
        Decision::AlreadyActive => "already active\n".to_string(),
        Decision::Not(why) => format!("not activated: {why}\n"),
    };
    // Not durable: it lives in /run, and means "this boot".
    if let Err(e) = crate::base::fsutil::write_atomic(&config.boot_marker, text.as_bytes()) {
        tracing::warn!(marker = %config.boot_marker.display(), error = %e, "recover: cannot write the boot marker; a restart of this agent decides again");
    }
    Some(decision)
}

async fn decide(config: &Recover) -> Decision {
    // A retire request from before the reboot would end the recovery at once.
    let _ = std::fs::remove_file(&config.retire_file);
    let manifest = config.static_pod_dir.join(manifest_name());
    if manifest.exists() {
        return Decision::AlreadyActive;
    }
    let bytes = match std::fs::read(&config.checkpoint) {
        Ok(b) => b,
        Err(e) => {
            return Decision::Not(format!(
                "no checkpoint at {}: {e}",
                config.checkpoint.display()
            ))
        }
    };
    // Read with nothing lost (a field this build does not know refuses it: the kubelet would
    // run what this build cannot check), then checked.
    let checked = serde_json::from_slice(&bytes)
        .map_err(Refusal::from)
        .and_then(|file| {
            let pod = staticpod::read(file)?;
            Ok((staticpod::validate(&pod, &config.policy)?, pod))
        });
    let (origin, pod) = match checked {
        Ok(checked) => checked,
        Err(e) => {
            return Decision::Not(format!(
                "checkpoint {} refused: {e}",
                config.checkpoint.display()
            ))
        }
    };
    if let Some(why) = config
        .kubeadm_manifest
        .as_deref()
        .and_then(|m| too_far_behind(&pod, m))
    {
        return Decision::Not(why);
    }
    if serves(config.node_address).await {
        return Decision::Not(format!(
            "{} accepts connections: an apiserver serves the node already",
            config.node_address
        ));
    }
    // Durably: after a power loss during the recovery the next boot finds it (`AlreadyActive`)
    // and the kubelet runs it; an empty file would be neither activated again nor run.
    match crate::base::fsutil::write_durable(
        &manifest,
        &bytes,
        crate::node::manifest::MANIFEST_MODE,
    ) {
        Ok(()) => Decision::Activated(origin.pod),
        Err(e) => Decision::Not(format!("cannot write {}: {e}", manifest.display())),
    }
}

/// Why a checkpoint whose apiserver is more than one minor version behind kubeadm's manifest's
/// is not activated (None: it may be, or there is nothing to compare). Such an apiserver would
/// serve data written by a newer one, to clients and kubelets of a newer one: Kubernetes
/// supports one minor of skew. `--allow-version-skew` activates it anyway.
fn too_far_behind(checkpoint: &Pod, kubeadm_manifest: &Path) -> Option<String> {
    let image = checkpoint
        .spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == crate::node::apiserver_manifest::CONTAINER)?
        .image
        .clone()?;
    let text = match std::fs::read_to_string(kubeadm_manifest) {
        Ok(t) => t,
        Err(e) => {
            tracing::info!(manifest = %kubeadm_manifest.display(), error = %e, "recover: kubeadm's manifest not read; the checkpoint's version is not compared with it");
            return None;
        }
    };
    let kubeadm = crate::node::apiserver_manifest::StaticPod::parse(&text)
        .ok()?
        .image();
    let (km, kn, ..) = crate::node::apiserver_manifest::image_version(&kubeadm)?;
    let (cm, cn, ..) = crate::node::apiserver_manifest::image_version(&image)?;
    (cm < km || (cm == km && cn + 1 < kn)).then(|| {
        format!(
            "checkpoint runs {} and kubeadm's manifest {} {}: more than one minor version behind (--allow-version-skew to activate it anyway)",
            image,
            kubeadm_manifest.display(),
            kubeadm
        )
    })
}

/// Why the checkpoint file is not activated.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("not JSON: {0}")]
    NotJson(#[from] serde_json::Error),
    #[error(transparent)]
    Unusable(#[from] staticpod::Unusable),
}

/// Whether something accepts a TCP connection on `addr` within 1 s.
async fn serves(addr: SocketAddr) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect(addr)).await,
        Ok(Ok(_))
    )
}

/// Acts on a retire request: removes the manifest, then the request.
pub fn retire(config: &Recover) {
    if !config.retire_file.exists() {
        return;
    }
    let manifest = config.static_pod_dir.join(manifest_name());
    match std::fs::remove_file(&manifest) {
        Ok(()) => {
            tracing::info!(manifest = %manifest.display(), "recover: recovery instance retired (an instance of the Deployment is ready): manifest removed, the kubelet stops it and its proxy hands the listening socket over")
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(manifest = %manifest.display(), error = %e, "recover: cannot remove the recovery instance's manifest");
            return;
        }
    }
    remove(&config.retire_file);
}

fn remove(path: &Path) {
    if let Err(e) = std::fs::remove_file(path) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(file = %path.display(), error = %e, "recover: cannot remove");
        }
    }
}

/// The checkpoint writer's state between attempts: what was last logged, and its metrics.
struct Writer {
    metrics: CheckpointMetrics,
    last: Option<String>,
    last_logged: Option<std::time::Instant>,
}

impl Writer {
    fn new(metrics: CheckpointMetrics) -> Self {
        Self {
            metrics,
            last: None,
            last_logged: None,
        }
    }

    /// One attempt; counts it, and logs a change of outcome (an unchanged failure or refusal at
    /// most every 5 minutes).
    async fn attempt(&mut self, config: &crate::node::recovery::checkpoint::WriterConfig) {
        use crate::node::recovery::checkpoint::Outcome;
        let now = std::time::SystemTime::now();
        let result = crate::node::recovery::checkpoint::attempt(config, now).await;
        let m = &self.metrics;
        let label = match &result {
            Ok(Outcome::Written(_)) => "written",
            Ok(Outcome::Current) => "current",
            Ok(Outcome::Kept(_)) => "kept",
            Ok(Outcome::NoCandidate) => "no_candidate",
            Ok(Outcome::Refused { .. }) => "refused",
            Err(_) => "error",
        };
        m.attempts.with_label_values(&[label]).inc();
        match &result {
            Ok(Outcome::Written(_) | Outcome::Current) => {
                m.refused.set(0);
                m.verified.set(unix_seconds(Some(now)));
            }
            Ok(Outcome::Refused { .. }) => m.refused.set(1),
            // The newest pod is not ready long enough yet, or an older one is listed: nothing
            // new is known about the checkpoint; an error: nothing at all.
            _ => {}
        }
        let (text, warn) = match &result {
            Ok(Outcome::Written(pod)) => {
                m.written
                    .set(unix_seconds(crate::node::recovery::checkpoint::written_at(
                        &config.dir,
                    )));
                tracing::info!(pod, file = %config.dir.join(crate::node::recovery::checkpoint::FILE).display(), after = ?config.after, "recover: checkpoint written: this pod was ready without a break for --checkpoint-after, the last known good one");
                self.last = None;
                return;
            }
            Ok(Outcome::NoCandidate) => ("no pod ready long enough yet".to_string(), false),
            Ok(Outcome::Current) => (
                "checkpoint kept: this pod is already the checkpoint".to_string(),
                false,
            ),
            Ok(Outcome::Kept(why)) => (format!("checkpoint kept: {why}"), false),
            Ok(Outcome::Refused { pod, reason }) => (
                format!("checkpoint refused: pod {pod}: {reason}; the previous checkpoint stays"),
                true,
            ),
            Err(e) => (format!("checkpoint not written: {e}"), true),
        };
        let changed = self.last.as_deref() != Some(text.as_str());
        let stale = self
            .last_logged
            .is_none_or(|t| t.elapsed() > Duration::from_secs(300));
        if changed || (warn && stale) {
            if warn {
                tracing::warn!("recover: {text}");
            } else {
                tracing::info!("recover: {text}");
            }
            self.last = Some(text);
            self.last_logged = Some(std::time::Instant::now());
        }
    }
}
