//! `kube-apiserver-proxy kubeadm-sync`: the node agent that keeps kubeadm the source of truth
//! of a migrated controller, so that `kubeadm upgrade apply/node` and `kubeadm certs renew`
//! work unpatched.
//!
//! kubeadm writes its static pods to `/etc/kubernetes/manifests` (a constant of kubeadm's) and
//! checks and waits on them (kubeadm v1.37.2): `upgrade apply` needs exactly one kube-system pod
//! on the node labelled `component=kube-apiserver,tier=control-plane` with the advertise
//! endpoint annotation (`util/config/cluster.go` 333–350), the three manifests on disk
//! (`phases/upgrade/health.go` 241–258), the pod `kube-apiserver-<node>` (its
//! `kubernetes.io/config.hash`, `util/apiclient/wait.go` 422–446), and after writing a new
//! manifest it waits for that hash to change and for every `component=kube-apiserver` pod to
//! be Running (`phases/upgrade/staticpods.go` 263–276, `wait.go` 328–357). A kubelet that runs
//! that directory would start kubeadm's apiserver beside the proxy.
//!
//! So on a migrated node the kubelet runs another directory (`--static-pod-dir`, the kubelet's
//! `--pod-manifest-path`), and this agent keeps it in step with kubeadm's, every `--interval`:
//!
//! - every manifest but `kube-apiserver.yaml` is copied as it is (etcd, controller-manager,
//!   scheduler, anything else), and a copy whose source is gone is removed: kubeadm's upgrade
//!   of them, its waits and its rollbacks behave as on any kubeadm node. A changed or removed
//!   controller-manager or scheduler is stopped before its successor starts, and the leader
//!   lease it still holds is released ([`crate::node::kubeadm::leader_handover`]): the successor leads
//!   at once;
//! - `kube-apiserver.yaml` becomes the Deployment ([`crate::node::kubeadm::render`]): when kubeadm's manifest
//!   or a file its flags name changes (a new version, a flag, `kubeadm certs renew`) and has
//!   been stable for `--settle`, the Deployment is rendered again and replaced (a surge
//!   rollout); every pass compares the live Deployment's template with what kubeadm's manifest
//!   renders and converges to it, forward or back, without waiting on the rollout (so the other
//!   copies go on); a rollout that does not complete within `--rollout-timeout` (4m, below
//!   kubeadm's 5m wait) or that the Deployment reports `ProgressDeadlineExceeded` is logged as
//!   failed, and when kubeadm then puts its old manifest back the Deployment is replaced by it;
//! - in its place the kubelet runs this agent itself as the static pod `kube-apiserver` (the
//!   *stand-in*, [`standin`](crate::node::kubeadm::standin)): the mirror pod `kube-system/kube-apiserver-<node>` that kubeadm
//!   and Cluster API look up, with kubeadm's labels and annotations, kubeadm's image in its
//!   first container (`kubeadm upgrade plan` reads versions there) and kubeadm's readiness
//!   probe, which goes through the node address to whichever apiserver serves it. The stand-in
//!   carries the digests it stands for; it is rewritten only once the rollout is complete, so
//!   the hash kubeadm waits on changes exactly when the new apiserver serves.
//!
//! kubeadm's upgrade of etcd (a new image, etcd's flags with it) would replace etcd's pod: a
//! new UID, and the kubelet deletes the old mirror pod through the apiserver before it starts
//! the new etcd, a call that waits while etcd is down (about a minute of outage). So when only
//! etcd's containers change and each of them changes its image, the copy keeps the running
//! pod's UID ([`restarts_in_place`]): the kubelet updates the pod and restarts those containers
//! in their sandbox, with no API call, after a grace period of 2 s ([`RESTART_GRACE`]: etcd's
//! short requests are done, its drain is held only by watches, which resume); the apiserver's
//! requests wait for the new one. The kubelet leaves the mirror pod as it was, so once the pod
//! runs the new containers, ready, the agent writes their images and a new
//! `kubernetes.io/config.hash` into it ([`Sync::fix_mirrors`]): what kubeadm waits on and reads;
//! and the copy gets kubeadm's grace period back. Before any change of etcd's copy, kubeadm's new
//! etcd pod runs as a canary ([`crate::node::kubeadm::etcd_canary`]): one that cannot start leaves etcd
//! untouched.
//!
//! The first pass at the migration (`--once`) adopts the running static pods: each copy gets the
//! running pod's UID (its mirror pod's `kubernetes.io/config.hash`), so the kubelet, restarted
//! on the new directory, keeps etcd, the controller-manager and the scheduler running. It sets
//! kubeadm's apiserver manifest aside as `.kube-apiserver.yaml` (the kubelet ignores dot files)
//! and waits until kubeadm's apiserver has stopped, gracefully, within its grace period: a
//! kubelet restarted while it still ran would kill it as an orphan, cutting its requests; if it
//! still runs after `--once-timeout` (the kubelet down, or running another directory), the
//! manifest is put back and `--once` fails. The agent, once it runs from the new directory,
//! puts the manifest back.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::List;

use crate::base::fsutil::write_durable;
use crate::node::api::ApiClient;
use crate::node::apiserver_manifest::{StaticPod, CONTAINER};
use crate::node::kubeadm::etcd_canary;
use crate::node::kubeadm::leader_handover::{self, LEADERS};
use crate::node::kubeadm::render;
use crate::node::kubeadm::standin::standin;
use crate::node::manifest::{as_kubeadms, hostname, Manifest, GRACE_MARK, MANIFEST_MODE};
use crate::node::object::{self, Container, Deployment, ObjectMeta, Pod};

/// kubeadm's apiserver manifest, in both directories.
pub const APISERVER: &str = "kube-apiserver.yaml";
/// kubeadm's apiserver manifest set aside by `--once` (a dot file: the kubelet ignores it, so it
/// stops kubeadm's apiserver gracefully); the running agent puts it back.
pub const SET_ASIDE: &str = ".kube-apiserver.yaml";
/// The names of the copies this agent made (a dot file: the kubelet ignores it).
const MANAGED: &str = ".kubeadm-sync";
/// Why `kubeadm-sync` cannot start, or a pass failed.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Manifest { path: String, message: String },
    #[error("--kubeconfig: {0}")]
    Kubeconfig(String),
    #[error("{0}")]
    Api(String),
    #[error("{0}")]
    Rollout(String),
    #[error("the cluster has {count} control-plane nodes ({names}): kubeadm-sync renders the single-controller Deployment from this node's manifest, and on each controller it would replace it with its own in turn; run it on single-controller clusters only (several controllers: the ha-daemonset or ha-surge overlays, docs/runbooks/rollout.md)")]
    SeveralControllers { count: usize, names: String },
    #[error("--kubeadm-dir and --static-pod-dir must differ (the kubelet would run kubeadm's apiserver)")]
    SameDir,
    #[error("kubeadm-sync --undo: {path}: {why}; nothing written")]
    Undo { path: String, why: String },
    #[error("kubeadm's static apiserver (pid {pid}) still runs {waited:?} after its manifest was set aside; the manifest is put back, the node as before --once: do not restart the kubelet (it would kill that apiserver as an orphan, cutting its requests), find why the kubelet does not stop it (journalctl -u kubelet) and run --once again")]
    StaticApiserverRuns { pid: u32, waited: Duration },
}

impl crate::base::exit::CommandError for SyncError {
    /// Bad input (exit 2) rather than a runtime failure.
    fn is_bad_input(&self) -> bool {
        matches!(
            self,
            SyncError::Kubeconfig(_)
                | SyncError::SameDir
                | SyncError::SeveralControllers { .. }
                | SyncError::Undo { .. }
        )
    }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SyncError + 'a {
    move |source| SyncError::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

/// The digests a stand-in or a pod template stands for: (manifest, files).
pub fn digests(meta: &ObjectMeta) -> (Option<&str>, Option<&str>) {
    (
        object::annotation(meta, render::MANIFEST_DIGEST),
        object::annotation(meta, render::FILES_DIGEST),
    )
}

/// The digests a Deployment's pod template stands for ([`digests`]).
fn template_digests(d: &Deployment) -> (Option<&str>, Option<&str>) {
    match &d.spec.template.metadata {
        Some(meta) => digests(meta),
        None => (None, None),
    }
}

/// The grace period of etcd's container when it restarts in place: etcd drains its requests
/// for up to 7 s after SIGTERM, held by the apiserver's watch streams, while the apiserver's
/// new requests wait; by 2 s (the kubelet's minimum) its unary requests are done, and only the
/// watches are left, which the apiserver resumes from the next revision. Set only for the
/// restart (kubeadm's pod sets none: 30 s), and taken out once the new etcd serves.
pub const RESTART_GRACE: i64 = 2;

/// `copy` (kubeadm's etcd pod with the running UID) with [`RESTART_GRACE`], when kubeadm's
/// pod sets no grace period of its own.
fn with_restart_grace(mut copy: Manifest) -> Manifest {
    copy.edit(|pod| {
        let spec = pod.spec.get_or_insert_with(Default::default);
        if spec.termination_grace_period_seconds.is_none() {
            spec.termination_grace_period_seconds = Some(RESTART_GRACE);
            pod.metadata
                .annotations
                .get_or_insert_with(Default::default)
                .insert(GRACE_MARK.to_owned(), RESTART_GRACE.to_string());
        }
    });
    copy
}

/// Whether a copy holds the same pod as its source (`metadata.uid`, set at adoption, aside).
pub fn same_pod(source: &Pod, copy: &Pod) -> bool {
    as_kubeadms(source) == as_kubeadms(copy)
}

/// The static pod whose copy keeps the running UID when kubeadm changes only its images:
/// etcd's, whose replacement by a new pod waits on the API while etcd itself is down. (The
/// controller-manager's and the scheduler's replacements cost nothing: the apiserver serves.)
pub const RESTART_IN_PLACE: &str = "etcd.yaml";

/// Whether the kubelet brings its pod from `old` to `new` by restarting containers in place
/// when the UID stays: the pods are the same but for their containers, and every container
/// that differs runs another image. The kubelet keeps a pod whose UID it knows and restarts a
/// container only when its name or image changed (`pkg/kubelet/container/helpers.go`,
/// `HashContainer`, v1.36 and v1.37); the restarted container runs the new spec whole (its
/// flags too). Any other change needs a new pod.
pub fn restarts_in_place(old: &Pod, new: &Pod) -> bool {
    let rest = |p: &Pod| {
        let mut p = as_kubeadms(p);
        if let Some(s) = p.spec.as_mut() {
            s.containers = Vec::new();
        }
        p
    };
    let (Some(a), Some(b)) = (containers(old), containers(new)) else {
        return false;
    };
    if rest(old) != rest(new) || a.len() != b.len() {
        return false;
    }
    let mut changed = false;
    for (x, y) in a.iter().zip(b) {
        if x.name != y.name || (x != y && x.image == y.image) {
            return false;
        }
        changed |= x != y;
    }
    changed
}

/// A pod's containers (none without a spec).
fn containers(pod: &Pod) -> Option<&[Container]> {
    pod.spec.as_ref().map(|s| s.containers.as_slice())
}

/// Whether a container's image as the kubelet reports it (`status.containerStatuses[].image`,
/// the runtime's name: `docker.io/library/…` added, or the same name) is `image`.
fn same_image(reported: &str, image: &str) -> bool {
    reported == image
        || reported.ends_with(&format!("/{image}"))
        || image.ends_with(&format!("/{reported}"))
}

/// Where a mirror pod stands against the copy its pod runs ([`mirror_update`]).
#[derive(Debug, PartialEq)]
pub enum Mirror {
    /// It shows the copy's images (or there is nothing to compare): nothing to do.
    InLine,
    /// The pod was restarted in place for the copy, and the kubelet does not yet report every
    /// container of the copy running its image and ready.
    Waiting,
    /// The new containers serve: the mirror pod with their images and the new config hash.
    Update(Box<Pod>),
}

/// What a mirror pod needs once its pod was restarted in place for `copy`: nothing while it
/// already shows the copy's images, a wait while the kubelet does not yet report every
/// container of `copy` running its image and ready, else the mirror pod with the copy's images
/// and `hash` as its `kubernetes.io/config.hash`.
pub fn mirror_update(mirror: &Pod, copy: &Pod, hash: &str) -> Mirror {
    let Some(wanted) = containers(copy) else {
        return Mirror::InLine;
    };
    let image_of = |name: &str| {
        containers(mirror)?
            .iter()
            .find(|c| c.name == name)?
            .image
            .as_deref()
    };
    if wanted
        .iter()
        .all(|c| image_of(&c.name) == c.image.as_deref())
    {
        return Mirror::InLine;
    }
    let Some(statuses) = mirror
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
    else {
        return Mirror::Waiting;
    };
    let serving = wanted.iter().all(|c| {
        statuses.iter().any(|st| {
            st.name == c.name
                && st.ready
                && st.state.as_ref().is_some_and(|s| s.running.is_some())
                && c.image.as_deref().is_some_and(|i| same_image(&st.image, i))
        })
    });
    if !serving {
        return Mirror::Waiting;
    }
    let mut m = mirror.clone();
    m.metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert("kubernetes.io/config.hash".to_owned(), hash.to_owned());
    if let Some(spec) = m.spec.as_mut() {
        for mc in &mut spec.containers {
            if let Some(c) = wanted.iter().find(|c| c.name == mc.name) {
                mc.image = c.image.clone();
            }
        }
    }
    m.status = None;
    Mirror::Update(Box::new(m))
}

/// What `kubectl rollout status` waits for: the controller saw the latest generation, every
/// replica is updated and available, and no old one is left.
pub fn rollout_done(d: &Deployment) -> bool {
    let st = d.status.clone().unwrap_or_default();
    let want = d.spec.replicas.unwrap_or(1);
    st.observed_generation.unwrap_or(0) >= d.metadata.generation.unwrap_or(1)
        && st.updated_replicas.unwrap_or(0) == want
        && st.available_replicas.unwrap_or(0) == want
        && st.replicas.unwrap_or(0) == want
        && st.unavailable_replicas.unwrap_or(0) == 0
}

/// The live Deployment with the rendered spec and labels (everything else, its
/// resourceVersion included, kept for a replace).
pub fn replaced(live: &Deployment, rendered: &Deployment) -> Deployment {
    let mut d = live.clone();
    d.spec = rendered.spec.clone();
    if let Some(l) = &rendered.metadata.labels {
        d.metadata
            .labels
            .get_or_insert_with(Default::default)
            .extend(l.clone());
    }
    d.status = None;
    d
}

/// A Deployment's containers that are not the apiserver's: the proxy's.
fn proxies(d: &Deployment) -> impl Iterator<Item = &Container> {
    d.spec
        .template
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default()
        .iter()
        .filter(|c| c.name != CONTAINER)
}

/// The proxy image of a live Deployment (its first container that is not the apiserver).
pub fn proxy_image(d: &Deployment) -> Option<String> {
    proxies(d).next()?.image.clone()
}

/// Whether a live Deployment's proxy runs with `--client-address transparent` (the mode is
/// the operator's choice, kept across kubeadm's changes like the proxy image).
pub fn transparent_client_address(d: &Deployment) -> bool {
    proxies(d)
        .flat_map(|c| c.args.iter().flatten())
        .any(|a| a == "--client-address=transparent")
}

/// The checked configuration.
#[derive(Debug)]
pub struct Sync {
    pub kubeadm_dir: PathBuf,
    pub static_pod_dir: PathBuf,
    pub node: String,
    pub namespace: String,
    pub deployment: String,
    pub proxy_image: String,
    pub interval: Duration,
    pub settle: Duration,
    pub rollout_timeout: Duration,
    /// The canary of etcd's changes ([`crate::node::kubeadm::etcd_canary`]): its timeout (zero: none)
    /// and its client port.
    pub etcd_canary_timeout: Duration,
    pub etcd_canary_port: u16,
    /// The last change of etcd's manifest whose canary ran: its digest, when, and whether it
    /// passed (a failed one is tried again after [`CANARY_RETRY`]).
    canaried: std::sync::Mutex<Option<Canaried>>,
    /// The kubeconfig (kubeadm's admin.conf), read again on every pass: `kubeadm certs renew`
    /// rewrites it, and a client certificate read once would outlive its renewal.
    pub kubeconfig: PathBuf,
    /// The agent's own arguments (after the binary), for the stand-in's command.
    pub command: Vec<String>,
}

/// What `kubeadm-sync` is asked for (its flags, `cli::KubeadmSyncArgs`; `--undo` and
/// `--write-kubeconfig` are other jobs, run by the binary).
#[derive(Debug, Clone)]
pub struct Options {
    /// kubeadm's static pod directory (a constant of kubeadm's).
    pub kubeadm_dir: PathBuf,

    /// The directory the kubelet runs (its --pod-manifest-path on a migrated controller).
    pub static_pod_dir: PathBuf,

    /// The agent's own credentials, read again on every pass: the kubeconfig
    /// --write-kubeconfig writes (a ServiceAccount's token with only what the agent calls).
    /// Any kubeconfig whose user may do the same works (kubeadm's admin.conf did, with every
    /// right of the cluster).
    pub kubeconfig: PathBuf,

    /// This node's name (the mirror pods are `<name>-<node>`).
    pub node_name: Option<String>,

    /// Namespace of the apiserver Deployment.
    pub namespace: String,

    /// Name of the apiserver Deployment.
    pub deployment: String,

    /// The proxy image: this agent's own (its init container), and the Deployment's sidecar
    /// when the live Deployment has none.
    pub proxy_image: Option<String>,

    /// How often the directories are compared.
    pub interval: Duration,

    /// How long kubeadm's apiserver inputs must stay unchanged before a rollout (kubeadm renews
    /// certificates, then writes the manifest).
    pub settle: Duration,

    /// How long a rollout to kubeadm's manifest may take before it is reported failed (so is
    /// one whose Deployment reports ProgressDeadlineExceeded). Below kubeadm's own wait (5m,
    /// UpgradeConfiguration timeouts.upgradeManifests), which then fails and puts the old
    /// manifest back, which the agent rolls the Deployment back to. `--once` waits this long.
    pub rollout_timeout: Duration,

    /// How long the canary of a change to etcd's manifest may take to serve: kubeadm's new
    /// etcd pod, run first as a learner member beside the running etcd (its own ports, its data
    /// in an emptyDir), must apply the cluster's data before etcd's copy is changed; failed or
    /// past this, etcd is left as it runs and kubeadm's wait fails (it puts its manifest
    /// back). Below kubeadm's wait (5m), with room for etcd's restart. 0s: no canary.
    pub etcd_canary_timeout: Duration,

    /// The canary's client port on 127.0.0.1; its peer port is the next, its metrics port the
    /// one after (2479, 2480, 2481: beside etcd's 2379, 2380, 2381).
    pub etcd_canary_port: u16,

    /// One pass, at the migration: copy the manifests (each keeps the running pod's UID, so
    /// nothing restarts when the kubelet moves to --static-pod-dir), write the stand-in, set
    /// kubeadm's apiserver manifest aside until the agent runs, wait for kubeadm's apiserver to
    /// exit; then restart the kubelet on --static-pod-dir.
    pub once: bool,

    /// With --once: how long kubeadm's static apiserver may take to exit once its manifest is
    /// set aside (the kubelet's look at the directory, then the pod's grace period, 30s).
    /// Still running then: the manifest is put back and --once fails (exit 1), so that the
    /// kubelet is not restarted under it.
    pub once_timeout: Duration,
}

impl TryFrom<&Options> for Sync {
    type Error = SyncError;

    fn try_from(a: &Options) -> Result<Self, SyncError> {
        if a.kubeadm_dir == a.static_pod_dir {
            return Err(SyncError::SameDir);
        }
        // Checked at the start (a bad one is bad input), read again on every pass.
        ApiClient::from_kubeconfig(&a.kubeconfig).map_err(|e| {
            let hint = if a.kubeconfig.exists() {
                ""
            } else {
                " (the agent's own is written by `kube-apiserver-proxy kubeadm-sync --write-kubeconfig --node-name NAME`, docs/runbooks/migrate-from-kubeadm.md step 6)"
            };
            SyncError::Kubeconfig(format!("{e}{hint}"))
        })?;
        let command = vec![
            "kubeadm-sync".to_owned(),
            format!("--kubeadm-dir={}", a.kubeadm_dir.display()),
            format!("--static-pod-dir={}", a.static_pod_dir.display()),
            format!("--kubeconfig={}", a.kubeconfig.display()),
            format!("--node-name={}", a.node_name.as_deref().unwrap_or_default()),
            format!("--namespace={}", a.namespace),
            format!("--deployment={}", a.deployment),
            format!(
                "--proxy-image={}",
                a.proxy_image.as_deref().unwrap_or_default()
            ),
            format!("--interval={}", humantime::format_duration(a.interval)),
            format!("--settle={}", humantime::format_duration(a.settle)),
            format!(
                "--rollout-timeout={}",
                humantime::format_duration(a.rollout_timeout)
            ),
            format!(
                "--etcd-canary-timeout={}",
                humantime::format_duration(a.etcd_canary_timeout)
            ),
            format!("--etcd-canary-port={}", a.etcd_canary_port),
        ];
        Ok(Sync {
            kubeadm_dir: a.kubeadm_dir.clone(),
            static_pod_dir: a.static_pod_dir.clone(),
            node: a.node_name.clone().unwrap_or_default(),
            namespace: a.namespace.clone(),
            deployment: a.deployment.clone(),
            proxy_image: a.proxy_image.clone().unwrap_or_default(),
            interval: a.interval,
            settle: a.settle,
            rollout_timeout: a.rollout_timeout,
            etcd_canary_timeout: a.etcd_canary_timeout,
            etcd_canary_port: a.etcd_canary_port,
            canaried: std::sync::Mutex::new(None),
            kubeconfig: a.kubeconfig.clone(),
            command,
        })
    }
}

/// Non-dot regular files of `dir`, by name.
pub(crate) fn manifests(dir: &Path) -> Result<BTreeSet<String>, SyncError> {
    let mut names = BTreeSet::new();
    for entry in std::fs::read_dir(dir).map_err(io("read", dir))? {
        let entry = entry.map_err(io("read", dir))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with('.') && entry.path().is_file() {
            names.insert(name);
        }
    }
    Ok(names)
}

/// The static pod of the file `path` ([`Manifest`]: a field this build does not know is
/// refused, named by its path).
pub(crate) fn read_pod(path: &Path) -> Result<Manifest, SyncError> {
    let bytes = std::fs::read(path).map_err(io("read", path))?;
    let text = String::from_utf8_lossy(&bytes);
    let manifest = |message: String| SyncError::Manifest {
        path: path.display().to_string(),
        message,
    };
    let mut docs =
        crate::base::yaml::parse_documents(&text).map_err(|e| manifest(e.to_string()))?;
    if docs.len() != 1 {
        return Err(manifest(format!(
            "{} documents, one pod expected",
            docs.len()
        )));
    }
    Manifest::from_value(docs.remove(0)).map_err(|e| manifest(e.to_string()))
}

/// The state a running agent keeps between passes.
#[derive(Debug, Default)]
pub struct State {
    /// The apiserver inputs last seen, and since when.
    seen: Option<((String, Option<String>), Instant)>,
    /// The rollout the Deployment is in, if any.
    rolling: Option<Rolling>,
}

/// The canary of one content of etcd's manifest ([`Sync::canary_passes`]).
#[derive(Debug)]
struct Canaried {
    digest: String,
    at: Instant,
    passed: bool,
}

/// When a content of etcd's manifest whose canary failed is tried again.
const CANARY_RETRY: Duration = Duration::from_secs(300);

/// A refused etcd manifest: one log line a minute.
static CANARY_REFUSED: crate::base::lograte::LogRate =
    crate::base::lograte::LogRate::new(Duration::from_secs(60));

/// A rollout seen running: since when, and whether its failure was reported.
#[derive(Debug)]
struct Rolling {
    since: Instant,
    failed: bool,
}

impl Sync {
    /// An API client from the kubeconfig as it is now.
    fn api(&self) -> Result<ApiClient, SyncError> {
        ApiClient::from_kubeconfig(&self.kubeconfig).map_err(|e| SyncError::Api(e.to_string()))
    }

    fn block_on<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        crate::base::runtime::block_on(f)
    }

    /// The running static pod's UID (its mirror pod's config hash), for adoption.
    fn running_uid(&self, pod: &Pod) -> Option<String> {
        let path = self.mirror_path(pod, "default")?;
        // Only looked at: read as far as this build knows pods (not refused for a field of a
        // newer Kubernetes, which would give the copy a new UID and restart its pod).
        let mirror: Pod = self.block_on(self.api().ok()?.get_as(&path)).ok()?;
        mirror
            .metadata
            .annotations?
            .remove("kubernetes.io/config.hash")
    }

    /// The API path of the mirror pod of the static pod `pod` on this node (its namespace,
    /// `default_ns` when it names none); none for a pod without a name.
    fn mirror_path(&self, pod: &Pod, default_ns: &str) -> Option<String> {
        let name = pod.metadata.name.as_deref()?;
        let ns = pod.metadata.namespace.as_deref().unwrap_or(default_ns);
        Some(object::path::<Pod>(ns, &format!("{name}-{}", self.node)))
    }

    /// Copies every manifest but the apiserver's; removes the copies whose source is gone.
    /// With `adopt`, a new copy gets the UID of the pod the kubelet runs now.
    pub fn copy_manifests(&self, adopt: bool) -> Result<Vec<String>, SyncError> {
        let mut changed = Vec::new();
        let managed_path = self.static_pod_dir.join(MANAGED);
        let before: BTreeSet<String> = std::fs::read_to_string(&managed_path)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        let mut now = BTreeSet::new();
        for name in manifests(&self.kubeadm_dir)? {
            if name == APISERVER {
                continue;
            }
            let src = self.kubeadm_dir.join(&name);
            let dst = self.static_pod_dir.join(&name);
            // Its source is there: its copy stays, even while the source cannot be read.
            now.insert(name.clone());
            let pod = match read_pod(&src) {
                Ok(p) => p,
                Err(e) => {
                    // Half-written (kubeadm init and editors write in place) or not a pod: the
                    // copy is left as it is (removing it would stop etcd); read again next pass.
                    tracing::warn!(error = %e, "kubeadm-sync: manifest not copied");
                    continue;
                }
            };
            let existing = read_pod(&dst);
            // kubeadm changed a controller's pod: the old one stopped first (its lease handed over).
            let replaced_leader = match &existing {
                Ok(copy)
                    if LEADERS.contains(&name.as_str()) && !same_pod(pod.pod(), copy.pod()) =>
                {
                    Some(copy.clone())
                }
                _ => None,
            };
            let mut in_place = false;
            // kubeadm changed etcd's pod: its canary first; failed, etcd runs on as it is.
            if let Ok(copy) = &existing {
                if name == RESTART_IN_PLACE
                    && !same_pod(pod.pod(), copy.pod())
                    && !self.canary_passes(copy, &pod)
                {
                    continue;
                }
            }
            let uid = match existing {
                Ok(copy) if same_pod(pod.pod(), copy.pod()) => {
                    // The same pod with its UID: nothing to do. Without one (written by an
                    // earlier release of this agent): the UID the kubelet gave it, so that
                    // nothing restarts; left as it is when the mirror pod cannot be read now.
                    if copy.pod().metadata.uid.is_some() {
                        continue;
                    }
                    match self.running_uid(pod.pod()) {
                        Some(uid) => uid,
                        None => continue,
                    }
                }
                // A new copy at the migration: the running pod's UID, which the kubelet,
                // restarted on this directory, keeps running.
                Err(_) if adopt => self
                    .running_uid(pod.pod())
                    .unwrap_or_else(|| pod.static_uid(&self.node, &name)),
                // kubeadm changed etcd's images (its upgrade): the running UID, so that the
                // kubelet restarts etcd in its pod, with no call to the API (fix_mirrors then
                // brings the mirror pod in line), after a short grace period.
                Ok(copy)
                    if name == RESTART_IN_PLACE
                        && copy.pod().metadata.uid.is_some()
                        && restarts_in_place(copy.pod(), pod.pod()) =>
                {
                    tracing::info!(
                        manifest = %name,
                        "kubeadm-sync: only its images changed: restarted in its pod, the UID kept"
                    );
                    in_place = true;
                    copy.pod().metadata.uid.clone().unwrap_or_default()
                }
                // kubeadm changed it: a new pod.
                _ => pod.static_uid(&self.node, &name),
            };
            let mut p = pod;
            p.edit(|p| p.metadata.uid = Some(uid));
            if in_place {
                p = with_restart_grace(p);
            }
            if let Some(old) = &replaced_leader {
                self.stop_leader(&dst, old.pod())?;
            }
            // Durably: the kubelet runs it after a power loss (etcd's too), and kubeadm's mode.
            write_durable(&dst, p.to_yaml().as_bytes(), MANIFEST_MODE)
                .map_err(io("write", &dst))?;
            changed.push(name);
        }
        for gone in before.difference(&now) {
            let dst = self.static_pod_dir.join(gone);
            if LEADERS.contains(&gone.as_str()) {
                if let Ok(old) = read_pod(&dst) {
                    self.stop_leader(&dst, old.pod())?;
                    changed.push(format!("-{gone}"));
                    continue;
                }
            }
            match std::fs::remove_file(&dst) {
                Ok(()) => changed.push(format!("-{gone}")),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("remove", &dst)(e)),
            }
        }
        if before != now {
            let list: String = now.iter().map(|n| format!("{n}\n")).collect();
            // Read at the first pass after a reboot: lost, a copy whose source went meanwhile
            // would stay. Its directory's fsync also keeps the removals above.
            write_durable(&managed_path, list.as_bytes(), MANIFEST_MODE)
                .map_err(io("write", &managed_path))?;
        }
        Ok(changed)
    }

    /// Removes the copy `dst` of a controller pod (`old`), waits for the kubelet to stop it
    /// and releases its leader lease ([`leader_handover`]): the pod that follows takes the lease
    /// at once instead of waiting out its duration.
    fn stop_leader(&self, dst: &Path, old: &Pod) -> Result<(), SyncError> {
        match std::fs::remove_file(dst) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("remove", dst)(e)),
        }
        let (Some(lease), Some(name), Some(uid), Some(mirror)) = (
            leader_handover::lease_of(old),
            old.metadata.name.as_deref(),
            old.metadata.uid.as_deref(),
            self.mirror_path(old, "kube-system"),
        ) else {
            return Ok(());
        };
        let ns = old.metadata.namespace.as_deref().unwrap_or("kube-system");
        let host = hostname();
        let hosts = [host.as_str(), self.node.as_str()];
        let started = Instant::now();
        let outcome = self.block_on(leader_handover::after_stop(
            || self.api().ok(),
            &mirror,
            uid,
            (&lease.0, &lease.1),
            &hosts,
        ));
        let lease = format!("{}/{}", lease.0, lease.1);
        let waited_ms = started.elapsed().as_millis() as u64;
        match outcome {
            Ok(leader_handover::Handover::Released(holder)) => tracing::info!(
                pod = %format!("{ns}/{name}-{}", self.node), lease, holder, waited_ms,
                "kubeadm-sync: the old pod stopped; its leader lease released, the new pod leads at once"
            ),
            Ok(leader_handover::Handover::NotHeld) => tracing::info!(
                pod = %format!("{ns}/{name}-{}", self.node), lease, waited_ms,
                "kubeadm-sync: the old pod stopped; its lease was not held by it (released at its exit)"
            ),
            Ok(leader_handover::Handover::StillRunning) => tracing::warn!(
                pod = %format!("{ns}/{name}-{}", self.node), lease, waited_ms,
                "kubeadm-sync: the old pod's mirror pod is still there; its lease left to expire"
            ),
            Err(e) => tracing::warn!(
                pod = %format!("{ns}/{name}-{}", self.node), lease, error = %e,
                "kubeadm-sync: the old pod's lease not released; left to expire"
            ),
        }
        Ok(())
    }

    /// Whether kubeadm's new etcd pod `new` may replace the running copy `running`: its canary
    /// ([`etcd_canary`]) served, now or for the same content before. A failed canary is tried
    /// again for the same content after [`CANARY_RETRY`] (kubeadm's own wait, after which an
    /// upgrade has put its manifest back; a manifest changed by hand stays refused, logged).
    fn canary_passes(&self, running: &Manifest, new: &Manifest) -> bool {
        if self.etcd_canary_timeout.is_zero() {
            return true;
        }
        let digest = new.static_uid(&self.node, RESTART_IN_PLACE);
        let mut memo = self.canaried.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = memo.as_ref().filter(|c| c.digest == digest) {
            if c.passed {
                return true;
            }
            if c.at.elapsed() < CANARY_RETRY {
                if let Some(suppressed) = CANARY_REFUSED.allow() {
                    tracing::warn!(suppressed, digest = %digest,
                        "kubeadm-sync: kubeadm's etcd manifest still not copied: its canary failed (above); retried {:?} after", CANARY_RETRY);
                }
                return false;
            }
        }
        tracing::info!(digest = %digest,
            "kubeadm-sync: kubeadm changed etcd's manifest: its canary first (the new pod as a learner member, beside etcd)");
        let ns = new
            .pod()
            .metadata
            .namespace
            .as_deref()
            .unwrap_or("kube-system");
        let mirror_path = object::path::<Pod>(ns, &format!("etcd-canary-{}", self.node));
        // One client for the canary's polls (the kubeconfig is read once per pass, not per poll).
        let api = self.api().ok();
        let mirror = || self.block_on(api.as_ref()?.get_as(&mirror_path)).ok();
        let passed = match self.canary().run(running.pod(), new.pod(), &mirror) {
            Ok(served) => {
                tracing::info!(version = %served.version, took = ?served.took,
                    "kubeadm-sync: etcd's canary served the cluster's data (learner removed): etcd's copy changed");
                true
            }
            Err(e) => {
                tracing::error!(error = %e,
                    "kubeadm-sync: etcd's canary failed (removed): kubeadm's etcd manifest not copied, etcd runs on untouched; an upgrade fails by kubeadm's wait, which puts its manifest back");
                false
            }
        };
        *memo = Some(Canaried {
            digest,
            at: Instant::now(),
            passed,
        });
        passed
    }

    /// The canary of etcd's changes, as the flags set it.
    fn canary(&self) -> etcd_canary::Canary<'_> {
        etcd_canary::Canary {
            static_pod_dir: &self.static_pod_dir,
            port: self.etcd_canary_port,
            timeout: self.etcd_canary_timeout,
        }
    }

    /// Removes what a canary left when the agent stopped half-way (its pod, its learner).
    fn canary_clean_up(&self) {
        let canary = self.canary();
        if !canary.left_behind() {
            return;
        }
        let copy = self.static_pod_dir.join(RESTART_IN_PLACE);
        let cleaned = read_pod(&copy)
            .map_err(|e| e.to_string())
            .and_then(|running| canary.clean_up(running.pod()).map_err(|e| e.to_string()));
        if let Err(e) = cleaned {
            tracing::warn!(error = %e, "kubeadm-sync: an earlier etcd canary not removed (the next canary tries again)");
        }
    }

    /// The mirror pod of a copy restarted in place (`RESTART_IN_PLACE`): once the kubelet
    /// reports the copy's containers running and ready, the mirror pod gets their images and a
    /// `kubernetes.io/config.hash` of the copy's content ([`static_uid`](crate::node::manifest::static_uid)), which kubeadm waits
    /// to see change before it checks the new etcd ([`mirror_update`]). Returns whether the
    /// mirror pod is in line (false: the new containers do not serve yet); an error while the
    /// apiserver cannot be reached (the next pass tries again).
    pub fn fix_mirrors(&self) -> Result<bool, SyncError> {
        let path = self.static_pod_dir.join(RESTART_IN_PLACE);
        let copy = match read_pod(&path) {
            Ok(copy) => copy,
            Err(_) if !path.exists() => return Ok(true),
            Err(e) => return Err(e),
        };
        let meta = &copy.pod().metadata;
        let (Some(name), Some(uid), Some(mirror_path)) = (
            meta.name.as_deref(),
            meta.uid.as_deref(),
            self.mirror_path(copy.pod(), "default"),
        ) else {
            return Ok(true);
        };
        let ns = meta.namespace.as_deref().unwrap_or("default");
        let api = self.api()?;
        // Refused when a field of it would be lost: it may be written back.
        let mirror: Pod = self
            .block_on(api.get_object(&mirror_path))
            .map_err(|e| SyncError::Api(e.to_string()))?;
        // Only the mirror pod of this very pod (a new UID means a new pod, a new mirror pod).
        if object::annotation(&mirror.metadata, object::MIRROR_OF) != Some(uid) {
            return Ok(true);
        }
        let hash = copy.static_uid(&self.node, RESTART_IN_PLACE);
        match mirror_update(&mirror, copy.pod(), &hash) {
            Mirror::InLine => {}
            Mirror::Waiting => return Ok(false),
            Mirror::Update(update) => {
                self.block_on(api.send_object("PUT", &mirror_path, &*update))
                    .map_err(|e| SyncError::Api(e.to_string()))?;
                tracing::info!(pod = %format!("{ns}/{name}-{}", self.node), hash = %hash,
                    "kubeadm-sync: mirror pod brought to the pod restarted in place (images, config hash)");
            }
        }
        // The new etcd serves: the copy back to kubeadm's grace period (a change of the pod
        // alone, with its UID: the kubelet restarts nothing).
        if meta
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(GRACE_MARK))
        {
            let uid = uid.to_owned();
            let mut plain = copy.as_kubeadms();
            plain.edit(|p| p.metadata.uid = Some(uid));
            write_durable(&path, plain.to_yaml().as_bytes(), MANIFEST_MODE)
                .map_err(io("write", &path))?;
        }
        Ok(true)
    }

    fn deployment_path(&self) -> String {
        object::path::<Deployment>(&self.namespace, &self.deployment)
    }

    /// One pass over the apiserver: converges the live Deployment's template to what kubeadm's
    /// manifest (and the files its flags name) renders, forward or back, and writes the
    /// stand-in once the rollout to it is complete. Never waits for a rollout: it starts one
    /// (a replace) and returns; later passes see it complete, or fail (`--rollout-timeout`, or
    /// the Deployment's `ProgressDeadlineExceeded`), while the other static pods' copies go on.
    ///
    /// Rolled back with kubeadm: when the new apiserver never gets ready, the stand-in stays
    /// as it was, so the hash kubeadm waits on never changes; kubeadm's wait fails and it puts
    /// its old manifest back; the next pass renders that, finds the live template different and
    /// replaces it: the Deployment goes back to the old template and its surge pod goes.
    pub fn apiserver(&self, state: &mut State, settle: bool) -> Result<Pass, SyncError> {
        let src = self.kubeadm_dir.join(APISERVER);
        if !src.exists() {
            return Ok(Pass::NoManifest);
        }
        let text = std::fs::read_to_string(&src).map_err(io("read", &src))?;
        let pod = StaticPod::parse(&text).map_err(|e| SyncError::Manifest {
            path: src.display().to_string(),
            message: e.to_string(),
        })?;
        let files = render::files_digest(&pod.files());
        let inputs = (pod.digest.clone(), files.clone());
        let dst = self.static_pod_dir.join(APISERVER);
        let current = read_pod(&dst).ok();
        let stands_for = current
            .as_ref()
            .map(|p| digests(&p.pod().metadata))
            .map(|(m, f)| (m.map(str::to_owned), f.map(str::to_owned)));
        let stood_for = stands_for == Some((Some(inputs.0.clone()), inputs.1.clone()));
        if stood_for {
            state.seen = None;
        } else if settle {
            // kubeadm renews certificates, then writes the manifest: follow once both settled.
            match &state.seen {
                Some((seen, since)) if *seen == inputs && since.elapsed() >= self.settle => {}
                Some((seen, _)) if *seen == inputs => return Ok(Pass::Settling),
                _ => {
                    state.seen = Some((inputs, Instant::now()));
                    return Ok(Pass::Settling);
                }
            }
        }
        let api = self.api()?;
        let live: Deployment = self
            .block_on(api.get_object(&self.deployment_path()))
            .map_err(|e| SyncError::Api(format!("GET {}: {e}", self.deployment_path())))?;
        let (base, _) = render::base().map_err(|e| SyncError::Api(e.to_string()))?;
        let options = render::Options {
            image: None,
            allow_downgrade: false,
            proxy_image: proxy_image(&live).or_else(|| Some(self.proxy_image.clone())),
            client_address_transparent: transparent_client_address(&live),
        };
        let rendered =
            render::deployment(&base, &pod, files.as_deref(), &options).map_err(|e| {
                SyncError::Manifest {
                    path: src.display().to_string(),
                    message: e.to_string(),
                }
            })?;
        let want = template_digests(&rendered);
        if template_digests(&live) != want {
            self.single_controller(&api)?;
            if stood_for {
                tracing::warn!(
                    manifest = %pod.digest,
                    image = %pod.image(),
                    "kubeadm-sync: the Deployment is not on kubeadm's manifest (kubeadm put its old manifest back after a failed upgrade, or the Deployment was changed); replacing it (rollback)"
                );
            } else {
                tracing::info!(
                    manifest = %pod.digest,
                    image = %pod.image(),
                    "kubeadm-sync: kubeadm's apiserver changed; replacing the Deployment (surge rollout)"
                );
            }
            self.block_on(api.send_object(
                "PUT",
                &self.deployment_path(),
                &replaced(&live, &rendered),
            ))
            .map_err(|e| SyncError::Api(format!("PUT {}: {e}", self.deployment_path())))?;
            state.rolling = Some(Rolling {
                since: Instant::now(),
                failed: false,
            });
            return Ok(Pass::RollingOut);
        }
        if !rollout_done(&live) {
            // Ours, or one this agent found running (it was restarted meanwhile).
            let rolling = state.rolling.get_or_insert(Rolling {
                since: Instant::now(),
                failed: false,
            });
            let deadline = progress_deadline_exceeded(&live);
            if !rolling.failed && (deadline || rolling.since.elapsed() > self.rollout_timeout) {
                rolling.failed = true;
                return Err(SyncError::Rollout(format!(
                    "the rollout of {} to kubeadm's manifest {} did not complete ({}); the stand-in stays as it was, so kubeadm's wait fails and it puts its old manifest back, which this agent then rolls the Deployment back to",
                    self.deployment_path(),
                    pod.digest,
                    if deadline {
                        "the Deployment reports ProgressDeadlineExceeded".to_owned()
                    } else {
                        format!("not within --rollout-timeout {:?}", self.rollout_timeout)
                    }
                )));
            }
            return Ok(Pass::RollingOut);
        }
        state.rolling = None;
        if stood_for {
            return Ok(Pass::InStep);
        }
        let stand = object::to_value(&standin(
            &pod,
            files.as_deref(),
            &self.proxy_image,
            &self.command,
            &[&self.kubeadm_dir, &self.static_pod_dir],
        ));
        // Written as a copy is: the document as built, with its UID.
        let mut stand = Manifest::from_value(stand).map_err(|e| SyncError::Manifest {
            path: dst.display().to_string(),
            message: e.to_string(),
        })?;
        let uid = stand.static_uid(&self.node, APISERVER);
        stand.edit(|p| p.metadata.uid = Some(uid));
        write_durable(&dst, stand.to_yaml().as_bytes(), MANIFEST_MODE)
            .map_err(io("write", &dst))?;
        tracing::info!(
            manifest = %pod.digest,
            "kubeadm-sync: rollout complete; stand-in kube-apiserver written (the kubelet restarts this agent)"
        );
        Ok(Pass::StandInWritten)
    }

    /// Refuses a cluster of several control-plane nodes (label
    /// `node-role.kubernetes.io/control-plane`, kubeadm's): each controller's agent would put
    /// the Deployment on its own manifest (they differ at least by `--advertise-address`), for
    /// ever. Nodes that cannot be listed do not stop the pass (logged).
    fn single_controller(&self, api: &ApiClient) -> Result<(), SyncError> {
        const PATH: &str = "/api/v1/nodes?labelSelector=node-role.kubernetes.io%2Fcontrol-plane";
        let nodes: List<Node> = match self.block_on(api.get_as(PATH)) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e, "kubeadm-sync: the control-plane nodes cannot be listed; assuming this one alone");
                return Ok(());
            }
        };
        let names: Vec<&str> = nodes
            .items
            .iter()
            .filter_map(|n| n.metadata.name.as_deref())
            .collect();
        if names.len() > 1 {
            return Err(SyncError::SeveralControllers {
                count: names.len(),
                names: names.join(", "),
            });
        }
        Ok(())
    }

    /// Passes until the Deployment is on kubeadm's manifest and the stand-in says so (`--once`):
    /// an error when the rollout fails or takes longer than `--rollout-timeout`.
    fn apiserver_until_in_step(&self) -> Result<(), SyncError> {
        let mut state = State::default();
        let started = Instant::now();
        loop {
            match self.apiserver(&mut state, false)? {
                Pass::RollingOut | Pass::Settling => {}
                Pass::NoManifest | Pass::InStep | Pass::StandInWritten => return Ok(()),
            }
            if started.elapsed() > self.rollout_timeout {
                return Err(SyncError::Rollout(format!(
                    "the rollout of {} did not complete within --rollout-timeout {:?}",
                    self.deployment_path(),
                    self.rollout_timeout
                )));
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

/// What one pass over the apiserver did ([`Sync::apiserver`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// kubeadm has no apiserver manifest (set aside by `--once`, or in the middle of a move).
    NoManifest,
    /// kubeadm's inputs changed and have not been stable for `--settle` yet.
    Settling,
    /// A rollout to kubeadm's manifest runs (just started, or seen running).
    RollingOut,
    /// The rollout is complete and the stand-in was written for it.
    StandInWritten,
    /// The Deployment and the stand-in are both on kubeadm's manifest.
    InStep,
}

/// Whether the Deployment controller gave up on the rollout (`Progressing` false with
/// `ProgressDeadlineExceeded`, past `progressDeadlineSeconds`).
pub fn progress_deadline_exceeded(d: &Deployment) -> bool {
    d.status
        .iter()
        .flat_map(|s| s.conditions.iter().flatten())
        .any(|c| {
            c.type_.as_deref() == Some("Progressing")
                && c.reason.as_deref() == Some("ProgressDeadlineExceeded")
        })
}

/// The pid of a kube-apiserver process other than a Deployment's (which binds a `127.`
/// address, `launch`'s): kubeadm's static apiserver. Only in this process's network namespace,
/// the node's (kubeadm's apiserver is on the host network, where `--once` runs): an apiserver
/// of another namespace (a test cluster, a nested node) does not hold the node's addresses.
fn static_apiserver() -> Option<u32> {
    let entries = std::fs::read_dir("/proc").ok()?;
    let our_net = std::fs::read_link("/proc/self/ns/net").ok();
    entries.flatten().find_map(|e| {
        let pid = e.file_name().to_str()?.parse().ok()?;
        if our_net.is_some() && std::fs::read_link(e.path().join("ns/net")).ok() != our_net {
            return None;
        }
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let mut args = cmdline.split(|b| *b == 0).filter(|a| !a.is_empty());
        let is_apiserver = args
            .next()
            .is_some_and(|a0| a0.rsplit(|b| *b == b'/').next() == Some(b"kube-apiserver"));
        (is_apiserver && !args.any(|a| a.starts_with(b"--bind-address=127."))).then_some(pid)
    })
}

/// `--once`, at the migration: the copies (with the running pods' UIDs) and the stand-in, then
/// kubeadm's manifest set aside so that the kubelet, still on kubeadm's directory, stops
/// kubeadm's apiserver gracefully (its grace period, as when the manifest is moved away by
/// hand); returns once that apiserver has exited. The kubelet is then restarted on
/// `--static-pod-dir`, where the agent runs and puts kubeadm's manifest back.
///
/// If that apiserver still runs after `wait` (the kubelet is down, or runs another directory),
/// restarting the kubelet would kill it as an orphan: the manifest is put back, leaving the
/// node as before (both apiservers serving), and `--once` fails.
fn once(sync: &Sync, wait: Duration) -> Result<(), SyncError> {
    let copied = sync.copy_manifests(true)?;
    tracing::info!(copied = ?copied, "kubeadm-sync: manifests copied");
    sync.apiserver_until_in_step()?;
    let manifest = sync.kubeadm_dir.join(APISERVER);
    if manifest.exists() {
        let aside = sync.kubeadm_dir.join(SET_ASIDE);
        std::fs::rename(&manifest, &aside).map_err(io("rename", &manifest))?;
        tracing::info!(
            aside = %aside.display(),
            "kubeadm-sync: kubeadm's manifest set aside; waiting for kubeadm's static apiserver to exit"
        );
    }
    let started = Instant::now();
    while let Some(pid) = static_apiserver() {
        if started.elapsed() > wait {
            if let Err(e) = restore(sync) {
                tracing::error!(error = %e, "kubeadm-sync: kubeadm's manifest not put back: move {} back to {} by hand", sync.kubeadm_dir.join(SET_ASIDE).display(), manifest.display());
            }
            return Err(SyncError::StaticApiserverRuns { pid, waited: wait });
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    tracing::info!(
        static_pod_dir = %sync.static_pod_dir.display(),
        "kubeadm-sync: ready: restart the kubelet with --pod-manifest-path={}",
        sync.static_pod_dir.display()
    );
    Ok(())
}

/// Puts back kubeadm's manifest that `--once` set aside (the agent runs: the kubelet runs
/// `--static-pod-dir`, not kubeadm's directory).
fn restore(sync: &Sync) -> Result<(), SyncError> {
    let aside = sync.kubeadm_dir.join(SET_ASIDE);
    let manifest = sync.kubeadm_dir.join(APISERVER);
    if aside.exists() && !manifest.exists() {
        std::fs::rename(&aside, &manifest).map_err(io("rename", &aside))?;
        tracing::info!(manifest = %manifest.display(), "kubeadm-sync: kubeadm's manifest put back");
    }
    Ok(())
}

/// Failed API calls of the passes: one log line a minute.
static API_ERRORS: crate::base::lograte::LogRate =
    crate::base::lograte::LogRate::new(Duration::from_secs(60));

/// The stand-in gone: one log line a minute.
static STANDIN_GONE: crate::base::lograte::LogRate =
    crate::base::lograte::LogRate::new(Duration::from_secs(60));

/// How often the agent's token's expiry is read (its warning comes once an hour).
const TOKEN_CHECK: Duration = Duration::from_secs(60);

/// The agent's token close to its expiry: one log line an hour.
static TOKEN_EXPIRY: crate::base::lograte::LogRate =
    crate::base::lograte::LogRate::new(Duration::from_secs(3600));

/// Warns when the kubeconfig's token expires within
/// [`identity::EXPIRY_WARNING`](crate::node::kubeadm::identity::EXPIRY_WARNING), or has.
fn check_token_expiry(kubeconfig: &Path) {
    let Some(expiry) = crate::node::kubeconfig::read(kubeconfig)
        .ok()
        .and_then(|k| k.token)
        .and_then(|t| crate::node::kubeconfig::token_expiry(&t))
    else {
        return;
    };
    let left = expiry
        .duration_since(std::time::SystemTime::now())
        .unwrap_or_default();
    if left < crate::node::kubeadm::identity::EXPIRY_WARNING {
        if let Some(suppressed) = TOKEN_EXPIRY.allow() {
            tracing::warn!(
                kubeconfig = %kubeconfig.display(),
                expires = %humantime::format_rfc3339_seconds(expiry),
                suppressed,
                "kubeadm-sync: this agent's token expires soon (or has): write its kubeconfig again with `kube-apiserver-proxy kubeadm-sync --write-kubeconfig --node-name NAME` (docs/runbooks/upgrade-kubernetes.md)"
            );
        }
    }
}

/// `kubeadm-sync`: one pass with `--once` (the migration), else passes every `--interval`
/// (`--undo` is [`crate::node::kubeadm::undo::undo`]).
pub fn run(args: &Options) -> Result<(), SyncError> {
    let sync = Sync::try_from(args)?;
    std::fs::create_dir_all(&sync.static_pod_dir).map_err(io("create", &sync.static_pod_dir))?;
    if args.once {
        return once(&sync, args.once_timeout);
    }
    if let Err(e) = restore(&sync) {
        tracing::warn!(error = %e, "kubeadm-sync: kubeadm's manifest not put back");
    }
    sync.canary_clean_up();
    tracing::info!(
        kubeadm_dir = %sync.kubeadm_dir.display(),
        static_pod_dir = %sync.static_pod_dir.display(),
        "kubeadm-sync: following kubeadm's manifests"
    );
    let mut state = State::default();
    // Whether etcd's mirror pod may lag its copy: at the start (a restart in place may have
    // been under way) and after each change of the copy, until fix_mirrors finds it in line.
    let mut mirror_due = true;
    let mut token_checked: Option<Instant> = None;
    loop {
        // The stand-in moved out of the kubelet's directory: going back
        // (docs/runbooks/going-back.md), and the kubelet stops this agent. Never written back:
        // the agent would start again and follow kubeadm's files on.
        if !sync.static_pod_dir.join(APISERVER).exists() {
            if let Some(suppressed) = STANDIN_GONE.allow() {
                tracing::warn!(
                    standin = %sync.static_pod_dir.join(APISERVER).display(),
                    suppressed,
                    "kubeadm-sync: the stand-in is gone from the kubelet's directory: nothing is followed any more (going back; the kubelet stops this agent)"
                );
            }
            std::thread::sleep(sync.interval);
            continue;
        }
        if token_checked.is_none_or(|t| t.elapsed() >= TOKEN_CHECK) {
            check_token_expiry(&sync.kubeconfig);
            token_checked = Some(Instant::now());
        }
        match sync.copy_manifests(false) {
            Ok(changed) if !changed.is_empty() => {
                mirror_due |= changed.iter().any(|c| c == RESTART_IN_PLACE);
                tracing::info!(changed = ?changed, "kubeadm-sync: static pods updated")
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "kubeadm-sync: copying manifests failed"),
        }
        if mirror_due {
            match sync.fix_mirrors() {
                Ok(in_line) => mirror_due = !in_line,
                // While etcd restarts the apiserver cannot answer: the next pass tries again.
                Err(e) => {
                    if let Some(suppressed) = API_ERRORS.allow() {
                        tracing::warn!(error = %e, suppressed, "kubeadm-sync: mirror pod not updated");
                    }
                }
            }
        }
        match sync.apiserver(&mut state, true) {
            Ok(_) => {}
            Err(e @ SyncError::Rollout(_)) => {
                tracing::error!(error = %e, "kubeadm-sync: the rollout to kubeadm's manifest failed")
            }
            Err(e @ SyncError::SeveralControllers { .. }) => {
                if let Some(suppressed) = API_ERRORS.allow() {
                    tracing::error!(error = %e, suppressed, "kubeadm-sync: the Deployment left as it is");
                }
            }
            // Every pass reads the Deployment: while the apiserver is unreachable (etcd or the
            // apiserver restarting), one line a minute.
            Err(e @ SyncError::Api(_)) => {
                if let Some(suppressed) = API_ERRORS.allow() {
                    tracing::warn!(error = %e, suppressed, "kubeadm-sync: apiserver not brought to kubeadm's manifest");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "kubeadm-sync: apiserver not brought to kubeadm's manifest")
            }
        }
        std::thread::sleep(sync.interval);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::manifest::static_uid;
    use serde_json::{json, Value};

    const KUBEADM: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  annotations:\n    kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint: 192.0.2.10:6443\n  labels:\n    component: kube-apiserver\n    tier: control-plane\n  name: kube-apiserver\n  namespace: kube-system\nspec:\n  containers:\n  - command: [kube-apiserver, --advertise-address=192.0.2.10, --secure-port=6443]\n    image: registry.k8s.io/kube-apiserver:v1.37.2\n    name: kube-apiserver\n    ports: [{containerPort: 6443, name: probe-port, protocol: TCP}]\n    readinessProbe: {httpGet: {host: 192.0.2.10, path: /readyz, port: probe-port, scheme: HTTPS}, periodSeconds: 1}\n    livenessProbe: {httpGet: {host: 192.0.2.10, path: /livez, port: probe-port, scheme: HTTPS}}\n  hostNetwork: true\n  priorityClassName: system-node-critical\n";

    #[test]
    fn the_standin_is_what_kubeadm_and_cluster_api_look_for() {
        let pod = StaticPod::parse(KUBEADM).unwrap();
        let s = standin(
            &pod,
            Some("f"),
            "kap:v1",
            &["kubeadm-sync".into()],
            &[
                Path::new("/etc/kubernetes/manifests"),
                Path::new("/etc/kubernetes/kubelet-manifests"),
            ],
        );
        let meta = &s.metadata;
        assert_eq!(meta.name.as_deref(), Some("kube-apiserver"));
        assert_eq!(meta.namespace.as_deref(), Some("kube-system"));
        let labels = meta.labels.as_ref().unwrap();
        assert_eq!(labels["component"], "kube-apiserver");
        assert_eq!(labels["tier"], "control-plane");
        assert_eq!(
            meta.annotations.as_ref().unwrap()
                ["kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint"],
            "192.0.2.10:6443"
        );
        assert_eq!(digests(meta), (Some(pod.digest.as_str()), Some("f")));
        let spec = s.spec.as_ref().unwrap();
        let c = &spec.containers[0];
        let init = &spec.init_containers.as_ref().unwrap()[0];
        // `kubeadm upgrade plan` reads the version from the first container's image.
        assert_eq!(
            c.image.as_deref(),
            Some("registry.k8s.io/kube-apiserver:v1.37.2")
        );
        let readiness = c.readiness_probe.as_ref().unwrap();
        assert_eq!(
            readiness.http_get.as_ref().unwrap().path.as_deref(),
            Some("/readyz")
        );
        assert!(
            c.liveness_probe.is_none(),
            "an API outage must not restart the agent"
        );
        assert_eq!(c.command.as_ref().unwrap()[0], super::super::standin::BIN);
        assert_eq!(init.image.as_deref(), Some("kap:v1"));
        assert_eq!(spec.host_network, Some(true));
        // Least privilege: no capability, read-only root, /etc/kubernetes read-only but for
        // the two manifest directories.
        for c in [c, init] {
            let sc = c.security_context.as_ref().unwrap();
            assert_eq!(
                sc.capabilities.as_ref().unwrap().drop.as_deref(),
                Some(&["ALL".to_owned()][..])
            );
            assert_eq!(sc.read_only_root_filesystem, Some(true));
            assert_eq!(sc.allow_privilege_escalation, Some(false));
        }
        let mounts = c.volume_mounts.as_ref().unwrap();
        let writable: Vec<&str> = mounts
            .iter()
            .filter(|m| m.read_only != Some(true))
            .map(|m| m.mount_path.as_str())
            .collect();
        assert_eq!(
            writable,
            [
                "/etc/kubernetes/manifests",
                "/etc/kubernetes/kubelet-manifests"
            ]
        );
        assert!(mounts
            .iter()
            .any(|m| m.mount_path == "/etc/kubernetes" && m.read_only == Some(true)));
    }

    /// kubeadm's etcd manifest as kubeadm writes it (its nulls and empty objects included).
    const KUBEADM_ETCD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  annotations:\n    kubeadm.kubernetes.io/etcd.advertise-client-urls: https://192.0.2.10:2379\n  creationTimestamp: null\n  labels:\n    component: etcd\n    tier: control-plane\n  name: etcd\n  namespace: kube-system\nspec:\n  containers:\n  - command:\n    - etcd\n    - --advertise-client-urls=https://192.0.2.10:2379\n    - --data-dir=/var/lib/etcd\n    - --name=node-1\n    image: registry.k8s.io/etcd:3.6.16-0\n    imagePullPolicy: IfNotPresent\n    livenessProbe:\n      failureThreshold: 8\n      httpGet:\n        host: 127.0.0.1\n        path: /livez\n        port: probe-port\n        scheme: HTTP\n      initialDelaySeconds: 10\n      periodSeconds: 10\n      timeoutSeconds: 15\n    name: etcd\n    ports:\n    - containerPort: 2381\n      name: probe-port\n      protocol: TCP\n    resources:\n      requests:\n        cpu: 100m\n        memory: 100Mi\n    volumeMounts:\n    - mountPath: /var/lib/etcd\n      name: etcd-data\n  hostNetwork: true\n  priority: 2000001000\n  priorityClassName: system-node-critical\n  securityContext:\n    seccompProfile:\n      type: RuntimeDefault\n  volumes:\n  - hostPath:\n      path: /var/lib/etcd\n      type: DirectoryOrCreate\n    name: etcd-data\nstatus: {}\n";
    /// kubeadm's scheduler manifest, the same way.
    const KUBEADM_SCHEDULER: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  creationTimestamp: null\n  labels:\n    component: kube-scheduler\n    tier: control-plane\n  name: kube-scheduler\n  namespace: kube-system\nspec:\n  containers:\n  - command:\n    - kube-scheduler\n    - --kubeconfig=/etc/kubernetes/scheduler.conf\n    - --leader-elect=true\n    image: registry.k8s.io/kube-scheduler:v1.37.2\n    imagePullPolicy: IfNotPresent\n    name: kube-scheduler\n    resources:\n      requests:\n        cpu: 100m\n    volumeMounts:\n    - mountPath: /etc/kubernetes/scheduler.conf\n      name: kubeconfig\n      readOnly: true\n  hostNetwork: true\n  priority: 2000001000\n  priorityClassName: system-node-critical\n  securityContext:\n    seccompProfile:\n      type: RuntimeDefault\n  volumes:\n  - hostPath:\n      path: /etc/kubernetes/scheduler.conf\n      type: FileOrCreate\n    name: kubeconfig\nstatus: {}\n";

    /// A `Sync` on two fresh directories (the API never called: no kubeconfig).
    fn sync_on(tmp: &Path) -> Sync {
        let (kubeadm_dir, static_pod_dir) = (tmp.join("manifests"), tmp.join("kubelet"));
        std::fs::create_dir_all(&kubeadm_dir).unwrap();
        std::fs::create_dir_all(&static_pod_dir).unwrap();
        Sync {
            kubeadm_dir,
            static_pod_dir,
            node: "node-1".into(),
            namespace: "kube-system".into(),
            deployment: "kube-apiserver".into(),
            proxy_image: "kap:v1".into(),
            interval: Duration::from_secs(1),
            settle: Duration::ZERO,
            rollout_timeout: Duration::from_secs(1),
            etcd_canary_timeout: Duration::ZERO,
            etcd_canary_port: 0,
            canaried: std::sync::Mutex::new(None),
            kubeconfig: tmp.join("none"),
            command: vec![],
        }
    }

    /// What this agent writes into the kubelet's directory, and the UIDs, byte for byte as the
    /// releases before wrote them for the same kubeadm files (kubeadm's nulls kept): a copy or
    /// UID that changed with an upgrade of the agent would restart its static pod, etcd's among
    /// them. Pinned: never change these texts to make a change pass.
    #[test]
    fn the_copies_and_uids_are_what_earlier_releases_wrote() {
        const ETCD_UID: &str = "f490bd654fc82834edacef2b87fe67eb";
        const SCHEDULER_UID: &str = "5dfdbf0558dc666326c20c3dfcb7eb4c";
        const STANDIN_UID: &str = "510bccb3d28167488d0070e45ff0bf8a";
        const ETCD_COPY: &str = r#"apiVersion: v1
kind: Pod
metadata:
  annotations:
    kubeadm.kubernetes.io/etcd.advertise-client-urls: "https://192.0.2.10:2379"
  creationTimestamp: ~
  labels:
    component: etcd
    tier: control-plane
  name: etcd
  namespace: kube-system
  uid: f490bd654fc82834edacef2b87fe67eb
spec:
  containers:
    - command:
        - etcd
        - "--advertise-client-urls=https://192.0.2.10:2379"
        - "--data-dir=/var/lib/etcd"
        - "--name=node-1"
      image: "registry.k8s.io/etcd:3.6.16-0"
      imagePullPolicy: IfNotPresent
      livenessProbe:
        failureThreshold: 8
        httpGet:
          host: 127.0.0.1
          path: /livez
          port: probe-port
          scheme: HTTP
        initialDelaySeconds: 10
        periodSeconds: 10
        timeoutSeconds: 15
      name: etcd
      ports:
        - containerPort: 2381
          name: probe-port
          protocol: TCP
      resources:
        requests:
          cpu: 100m
          memory: 100Mi
      volumeMounts:
        - mountPath: /var/lib/etcd
          name: etcd-data
  hostNetwork: true
  priority: 2000001000
  priorityClassName: system-node-critical
  securityContext:
    seccompProfile:
      type: RuntimeDefault
  volumes:
    - hostPath:
        path: /var/lib/etcd
        type: DirectoryOrCreate
      name: etcd-data
status: {}
"#;
        const SCHEDULER_COPY: &str = r#"apiVersion: v1
kind: Pod
metadata:
  creationTimestamp: ~
  labels:
    component: kube-scheduler
    tier: control-plane
  name: kube-scheduler
  namespace: kube-system
  uid: 5dfdbf0558dc666326c20c3dfcb7eb4c
spec:
  containers:
    - command:
        - kube-scheduler
        - "--kubeconfig=/etc/kubernetes/scheduler.conf"
        - "--leader-elect=true"
      image: "registry.k8s.io/kube-scheduler:v1.37.2"
      imagePullPolicy: IfNotPresent
      name: kube-scheduler
      resources:
        requests:
          cpu: 100m
      volumeMounts:
        - mountPath: /etc/kubernetes/scheduler.conf
          name: kubeconfig
          readOnly: true
  hostNetwork: true
  priority: 2000001000
  priorityClassName: system-node-critical
  securityContext:
    seccompProfile:
      type: RuntimeDefault
  volumes:
    - hostPath:
        path: /etc/kubernetes/scheduler.conf
        type: FileOrCreate
      name: kubeconfig
status: {}
"#;
        // etcd's copy restarted in place: the short grace period, marked.
        // The same copy with the restart grace: its annotation and the grace period, nothing else.
        let etcd_graced = ETCD_COPY
            .replacen(
                "  annotations:\n",
                "  annotations:\n    kube-apiserver-proxy/restart-grace: \"2\"\n",
                1,
            )
            .replacen(
                "  volumes:\n",
                "  terminationGracePeriodSeconds: 2\n  volumes:\n",
                1,
            );
        let tmp = std::env::temp_dir().join(format!("kap-sync-pin-{}", rand::random::<u64>()));
        let sync = sync_on(&tmp);
        std::fs::write(sync.kubeadm_dir.join("etcd.yaml"), KUBEADM_ETCD).unwrap();
        std::fs::write(
            sync.kubeadm_dir.join("kube-scheduler.yaml"),
            KUBEADM_SCHEDULER,
        )
        .unwrap();
        std::fs::write(sync.kubeadm_dir.join(APISERVER), KUBEADM).unwrap();
        assert_eq!(
            sync.copy_manifests(false).unwrap(),
            ["etcd.yaml", "kube-scheduler.yaml"]
        );
        let read = |name: &str| std::fs::read_to_string(sync.static_pod_dir.join(name)).unwrap();
        assert_eq!(read("etcd.yaml"), ETCD_COPY);
        assert_eq!(read("kube-scheduler.yaml"), SCHEDULER_COPY);
        // Again: nothing to do.
        assert!(sync.copy_manifests(false).unwrap().is_empty());
        let doc = |text: &str| crate::base::yaml::parse_documents(text).unwrap().remove(0);
        assert_eq!(
            static_uid("node-1", "etcd.yaml", &doc(KUBEADM_ETCD)),
            ETCD_UID
        );
        assert_eq!(static_uid("node-1", "etcd.yaml", &doc(ETCD_COPY)), ETCD_UID);
        assert_eq!(
            static_uid("node-1", "kube-scheduler.yaml", &doc(KUBEADM_SCHEDULER)),
            SCHEDULER_UID
        );
        // The restart in place, and back to kubeadm's grace period (fix_mirrors).
        let graced = with_restart_grace(Manifest::from_value(doc(ETCD_COPY)).unwrap());
        assert_eq!(graced.to_yaml(), etcd_graced);
        assert_eq!(graced.static_uid("node-1", "etcd.yaml"), ETCD_UID);
        assert_eq!(
            static_uid("node-1", "etcd.yaml", graced.document()),
            ETCD_UID
        );
        let mut plain = graced.as_kubeadms();
        plain.edit(|p| p.metadata.uid = Some(ETCD_UID.to_owned()));
        assert_eq!(plain.to_yaml(), ETCD_COPY);
        // The stand-in's UID (the stand-in itself is render's).
        let pod = StaticPod::parse(KUBEADM).unwrap();
        let stand = object::to_value(&standin(
            &pod,
            Some("f"),
            "kap:v1",
            &["kubeadm-sync".into()],
            &[Path::new("/m"), Path::new("/k")],
        ));
        assert_eq!(static_uid("node-1", APISERVER, &stand), STANDIN_UID);
        // Written as built, with that UID (Sync::apiserver).
        let mut written = Manifest::from_value(stand.clone()).unwrap();
        assert_eq!(written.static_uid("node-1", APISERVER), STANDIN_UID);
        written.edit(|p| p.metadata.uid = Some(STANDIN_UID.to_owned()));
        assert_eq!(written.as_kubeadms().document(), &stand);
        assert!(written
            .to_yaml()
            .contains(&format!("\n  uid: {STANDIN_UID}\n")));
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    /// `pod` as a file read ([`Manifest`]).
    fn manifest(pod: &Pod) -> Manifest {
        Manifest::from_value(object::to_value(pod)).unwrap()
    }

    /// The first container of `pod`.
    fn first(pod: &mut Pod) -> &mut Container {
        &mut pod.spec.as_mut().unwrap().containers[0]
    }

    #[test]
    fn a_static_uid_follows_the_content_not_the_kubelet() {
        let pod: Pod = object::from_value(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "etcd", "namespace": "kube-system"},
            "spec": {"containers": [{"name": "etcd", "image": "etcd:v3.6.16"}]}}))
        .unwrap();
        let uid = static_uid("node-1", "etcd.yaml", &object::to_value(&pod));
        assert_eq!(uid.len(), 32);
        assert!(uid.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(manifest(&pod).static_uid("node-1", "etcd.yaml"), uid);
        // The same file again, with the UID it got: the same UID.
        let mut with_uid = pod.clone();
        with_uid.metadata.uid = Some(uid.clone());
        assert_eq!(
            static_uid("node-1", "etcd.yaml", &object::to_value(&with_uid)),
            uid
        );
        // Another image, file or node: another pod.
        let mut newer = pod.clone();
        first(&mut newer).image = Some("etcd:v3.7.0".into());
        assert_ne!(manifest(&newer).static_uid("node-1", "etcd.yaml"), uid);
        assert_ne!(manifest(&pod).static_uid("node-1", "etcd2.yaml"), uid);
        assert_ne!(manifest(&pod).static_uid("node-2", "etcd.yaml"), uid);
    }

    #[test]
    fn a_field_this_build_does_not_know_is_not_copied() {
        let tmp = std::env::temp_dir().join(format!("kap-sync-unknown-{}", rand::random::<u64>()));
        let sync = sync_on(&tmp);
        let unknown = KUBEADM_ETCD.replace(
            "  hostNetwork: true\n",
            "  hostNetwork: true\n  future: {}\n",
        );
        let src = sync.kubeadm_dir.join("etcd.yaml");
        std::fs::write(&src, &unknown).unwrap();
        let e = read_pod(&src).unwrap_err().to_string();
        assert!(e.starts_with(&src.display().to_string()), "{e}");
        assert!(e.contains("(spec.future;"), "{e}");
        assert!(sync.copy_manifests(false).unwrap().is_empty());
        assert!(!sync.static_pod_dir.join("etcd.yaml").exists());
        // The copy of kubeadm's earlier file stays as it is.
        std::fs::write(&src, KUBEADM_ETCD).unwrap();
        assert_eq!(sync.copy_manifests(false).unwrap(), ["etcd.yaml"]);
        let copy = std::fs::read(sync.static_pod_dir.join("etcd.yaml")).unwrap();
        std::fs::write(&src, &unknown).unwrap();
        assert!(sync.copy_manifests(false).unwrap().is_empty());
        assert_eq!(
            std::fs::read(sync.static_pod_dir.join("etcd.yaml")).unwrap(),
            copy
        );
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    fn etcd(image: &str, flags: &[&str]) -> Pod {
        object::from_value(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "etcd", "namespace": "kube-system", "uid": "u1",
                "annotations": {"kubeadm.kubernetes.io/etcd.advertise-client-urls": "https://10.0.0.1:2379"}},
            "spec": {"hostNetwork": true, "containers": [{"name": "etcd", "image": image, "command": flags}]}}))
        .unwrap()
    }

    #[test]
    fn only_an_image_change_restarts_in_place() {
        let old = etcd("registry.k8s.io/etcd:3.6.16-0", &["etcd", "--a"]);
        // The image, with or without the flags: the container restarts with the new spec.
        assert!(restarts_in_place(
            &old,
            &etcd("registry.k8s.io/etcd:3.7.0-0", &["etcd", "--a"])
        ));
        assert!(restarts_in_place(
            &old,
            &etcd("registry.k8s.io/etcd:3.7.0-0", &["etcd", "--b"])
        ));
        // The UID aside, nothing changed: nothing to restart.
        let mut same = old.clone();
        same.metadata.uid = None;
        assert!(!restarts_in_place(&old, &same));
        // The flags alone: the kubelet would not restart the container.
        assert!(!restarts_in_place(
            &old,
            &etcd("registry.k8s.io/etcd:3.6.16-0", &["etcd", "--b"])
        ));
        // Anything of the pod beside its containers: a new pod.
        let mut pod_level = etcd("registry.k8s.io/etcd:3.7.0-0", &["etcd", "--a"]);
        pod_level.spec.as_mut().unwrap().host_network = Some(false);
        assert!(!restarts_in_place(&old, &pod_level));
        let mut label = etcd("registry.k8s.io/etcd:3.7.0-0", &["etcd", "--a"]);
        label.metadata.labels = Some([("x".to_owned(), "y".to_owned())].into());
        assert!(!restarts_in_place(&old, &label));
        // A container more, or renamed.
        let mut more = etcd("registry.k8s.io/etcd:3.7.0-0", &["etcd", "--a"]);
        more.spec.as_mut().unwrap().containers.push(Container {
            name: "x".into(),
            image: Some("x".into()),
            ..Default::default()
        });
        assert!(!restarts_in_place(&old, &more));
        let mut renamed = etcd("registry.k8s.io/etcd:3.7.0-0", &["etcd", "--a"]);
        first(&mut renamed).name = "etcd2".into();
        assert!(!restarts_in_place(&old, &renamed));
    }

    fn mirror(image: &str, status_image: &str, ready: bool) -> Pod {
        object::from_value(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "etcd-n", "namespace": "kube-system", "resourceVersion": "7",
                "annotations": {"kubernetes.io/config.hash": "u1", "kubernetes.io/config.mirror": "u1"}},
            "spec": {"containers": [{"name": "etcd", "image": image}]},
            "status": {"containerStatuses": [{"name": "etcd", "image": status_image, "ready": ready,
                "state": {"running": {"startedAt": "2026-12-05T00:00:00Z"}}}]}}))
        .unwrap()
    }

    #[test]
    fn the_mirror_pod_follows_a_pod_restarted_in_place_once_it_serves() {
        let copy = etcd("registry.k8s.io/etcd:3.7.0-0", &["etcd"]);
        // Already the copy's images: nothing.
        let done = mirror(
            "registry.k8s.io/etcd:3.7.0-0",
            "registry.k8s.io/etcd:3.7.0-0",
            true,
        );
        assert_eq!(mirror_update(&done, &copy, "h2"), Mirror::InLine);
        // The old container still runs, or the new one is not ready: not yet.
        let old = mirror(
            "registry.k8s.io/etcd:3.6.16-0",
            "registry.k8s.io/etcd:3.6.16-0",
            true,
        );
        assert_eq!(mirror_update(&old, &copy, "h2"), Mirror::Waiting);
        let starting = mirror(
            "registry.k8s.io/etcd:3.6.16-0",
            "registry.k8s.io/etcd:3.7.0-0",
            false,
        );
        assert_eq!(mirror_update(&starting, &copy, "h2"), Mirror::Waiting);
        // Running and ready (the runtime's name for the image): images and hash, no status.
        for reported in [
            "registry.k8s.io/etcd:3.7.0-0",
            "docker.io/library/etcd:3.7.0-0",
        ] {
            let c = if reported.starts_with("docker") {
                etcd("etcd:3.7.0-0", &["etcd"])
            } else {
                copy.clone()
            };
            let serving = mirror("registry.k8s.io/etcd:3.6.16-0", reported, true);
            let Mirror::Update(u) = mirror_update(&serving, &c, "h2") else {
                panic!("an update for {reported}");
            };
            let annotations = u.metadata.annotations.as_ref().unwrap();
            assert_eq!(annotations["kubernetes.io/config.hash"], "h2");
            assert_eq!(annotations["kubernetes.io/config.mirror"], "u1");
            assert_eq!(u.metadata.resource_version.as_deref(), Some("7"));
            assert_eq!(
                u.spec.as_ref().unwrap().containers[0].image,
                c.spec.as_ref().unwrap().containers[0].image
            );
            assert!(u.status.is_none());
        }
    }

    #[test]
    fn copies_compare_without_the_adopted_uid() {
        let a: Pod = object::from_value(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "etcd"}, "spec": {"containers": [{"name": "etcd", "image": "e:1"}]}}))
        .unwrap();
        let mut b = a.clone();
        b.metadata.uid = Some("abc".into());
        assert!(same_pod(&a, &b));
        first(&mut b).image = Some("e:2".into());
        assert!(!same_pod(&a, &b));
    }

    #[test]
    fn the_restart_grace_is_the_agents_and_compares_away() {
        let grace = |m: &Manifest| {
            m.pod()
                .spec
                .as_ref()
                .and_then(|s| s.termination_grace_period_seconds)
        };
        let kubeadm = etcd("registry.k8s.io/etcd:3.7.0-0", &["--name=n"]);
        let mut copy = manifest(&kubeadm);
        copy.edit(|p| p.metadata.uid = Some("uid-etcd".into()));
        let short = with_restart_grace(copy.clone());
        assert_eq!(grace(&short), Some(2));
        assert!(same_pod(&kubeadm, short.pod()), "{short:?}");
        assert_eq!(
            short.static_uid("n", RESTART_IN_PLACE),
            manifest(&kubeadm).static_uid("n", RESTART_IN_PLACE)
        );
        // Taken out whole: no annotation left where kubeadm's pod had none.
        let mut bare = kubeadm.clone();
        bare.metadata.annotations = None;
        let bare_short = with_restart_grace(manifest(&bare));
        assert!(bare_short.pod().metadata.annotations.as_ref().unwrap()[GRACE_MARK] == "2");
        assert_eq!(as_kubeadms(bare_short.pod()), as_kubeadms(&bare));
        assert_eq!(
            bare_short.as_kubeadms().document(),
            manifest(&bare).as_kubeadms().document()
        );
        // The next image change still restarts in place from a copy that has it.
        let next = etcd("registry.k8s.io/etcd:3.7.1-0", &["--name=n"]);
        assert!(restarts_in_place(short.pod(), &next));
        // kubeadm's own grace period (a patch) stays: neither changed nor compared away.
        let mut patched = kubeadm.clone();
        patched
            .spec
            .as_mut()
            .unwrap()
            .termination_grace_period_seconds = Some(10);
        let kept = with_restart_grace(manifest(&patched));
        assert_eq!(grace(&kept), Some(10));
        assert!(!same_pod(&kubeadm, kept.pod()));
        // A grace period without the mark is not the agent's: it counts.
        let mut unmarked = kubeadm.clone();
        unmarked
            .spec
            .as_mut()
            .unwrap()
            .termination_grace_period_seconds = Some(2);
        assert!(!same_pod(&kubeadm, &unmarked));
    }

    use k8s_openapi::api::apps::v1::DeploymentStatus;

    fn deployment(value: Value) -> Deployment {
        object::from_value(value).unwrap()
    }

    #[test]
    fn rollout_done_as_kubectl_rollout_status() {
        let mut d = deployment(
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"generation": 3},
            "spec": {"replicas": 1},
            "status": {"observedGeneration": 3, "updatedReplicas": 1, "availableReplicas": 1, "replicas": 1}}),
        );
        assert!(rollout_done(&d));
        fn status(d: &mut Deployment) -> &mut DeploymentStatus {
            d.status.as_mut().unwrap()
        }
        status(&mut d).replicas = Some(2); // the old pod is still there
        assert!(!rollout_done(&d));
        status(&mut d).replicas = Some(1);
        status(&mut d).observed_generation = Some(2);
        assert!(!rollout_done(&d));
    }

    #[test]
    fn a_rollout_past_its_progress_deadline_is_seen() {
        let mut d = deployment(
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "status": {"conditions": [
            {"type": "Available", "status": "True", "reason": "MinimumReplicasAvailable"},
            {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}]}}),
        );
        assert!(!progress_deadline_exceeded(&d));
        let progressing = &mut d.status.as_mut().unwrap().conditions.as_mut().unwrap()[1];
        progressing.status = Some("False".into());
        progressing.reason = Some("ProgressDeadlineExceeded".into());
        assert!(progress_deadline_exceeded(&d));
        assert!(!progress_deadline_exceeded(&Deployment::default()));
    }

    #[test]
    fn replace_keeps_the_live_metadata() {
        let live = deployment(json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "kube-apiserver", "resourceVersion": "7", "labels": {"x": "y"}},
            "spec": {"replicas": 1}, "status": {"replicas": 1}}));
        let rendered = deployment(json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"labels": {"a": "b"}}, "spec": {"replicas": 2, "paused": true}}));
        let r = replaced(&live, &rendered);
        assert_eq!(r.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(
            r.metadata.labels,
            Some(
                [("x", "y"), ("a", "b")]
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .into()
            )
        );
        assert_eq!(r.spec, rendered.spec);
        assert!(r.status.is_none());
    }

    #[test]
    fn the_proxy_of_a_live_deployment_is_read_from_its_template() {
        let d = deployment(json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "spec": {"template": {"spec": {"containers": [
                {"name": CONTAINER, "image": "k:1", "args": ["--client-address=transparent"]},
                {"name": "proxy", "image": "kap:v2", "args": ["--client-address=transparent"]}]}}}}));
        assert_eq!(proxy_image(&d).as_deref(), Some("kap:v2"));
        assert!(transparent_client_address(&d));
        let mut plain = d.clone();
        let proxy = &mut plain.spec.template.spec.as_mut().unwrap().containers[1];
        proxy.args = None;
        assert!(!transparent_client_address(&plain));
        assert_eq!(proxy_image(&Deployment::default()), None);
    }
}
