//! The checkpoint of an apiserver pod as a static pod: the pure transformation applied to the pod
//! before it is written ([`crate::node::recovery::checkpoint`]), and the checks ([`Policy`], [`validate`]) made
//! on it when it is written and again before `recover` puts it into the kubelet's static pod
//! directory.
//!
//! A static pod cannot refer to API objects (the kubelet runs it before there is an API), so the
//! pod as the API returns it is reduced to what the kubelet needs on its own:
//!
//! - **metadata**: a fixed name ([`NAME`]), the pod's namespace, labels of its own (never the
//!   Deployment's: its selector, the PodDisruptionBudget and the anti-affinity must not match the
//!   mirror pod) and annotations naming the pod it is a copy of ([`OF`], [`OF_UID`],
//!   [`OF_CREATED`], [`AT`]);
//! - **spec**: what the scheduler, the admission plugins and the controllers added is dropped
//!   (`nodeName`, `priority`, `serviceAccountName`, tolerations, affinity, …); service account
//!   token volumes (the writer's own credential) and their mounts are dropped; a volume or an
//!   environment variable that needs the API (Secret, ConfigMap, PersistentVolumeClaim, …) makes
//!   the pod unusable as a checkpoint: better no new checkpoint than one that cannot start;
//! - **the proxy sidecar** (the container run with `--handoff-dir`) gets `--retire-file`, which
//!   makes it ask for its own removal once an instance of the Deployment is ready beside it.
//!
//! The pod and the checkpoint are k8s-openapi's [`Pod`]: one read from JSON (the API's answer, a
//! checkpoint file, [`read`]) that has a field this build does not know is refused, named by its
//! path ([`object::from_value`]), rather than written or activated without it.

use std::collections::BTreeMap;

use serde_json::Value;

use crate::node::object::{self, Container, ObjectMeta, Pod, PodSpec, Volume};

/// Name of the static pod (the mirror pod is `<NAME>-<node>`); the file in the static pod
/// directory is `<NAME>.json`.
pub const NAME: &str = "kube-apiserver-checkpoint";
/// Annotation: `namespace/name` of the pod this is a copy of.
pub const OF: &str = "kube-apiserver-proxy/checkpoint-of";
/// Annotation: that pod's uid.
pub const OF_UID: &str = "kube-apiserver-proxy/checkpoint-of-uid";
/// Annotation: that pod's `creationTimestamp` (RFC 3339, UTC): a newer pod's checkpoint is never
/// replaced by an older pod's.
pub const OF_CREATED: &str = "kube-apiserver-proxy/checkpoint-of-created";
/// Annotation: when the checkpoint was written (RFC 3339, UTC).
pub const AT: &str = "kube-apiserver-proxy/checkpointed-at";
/// The flag (or variable) that marks the proxy sidecar's container.
const PROXY_FLAG: &str = "--handoff-dir";
const PROXY_ENV: &str = "KUBE_APISERVER_PROXY_HANDOFF_DIR";

/// Why a pod cannot become a checkpoint, or a file cannot be activated: the rule it breaks, in
/// one line (no error lies underneath: every check here is of the pod itself).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unusable(pub String);

fn unusable(message: impl Into<String>) -> Unusable {
    Unusable(message.into())
}

/// Who the checkpoint is of, as recorded in its annotations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// `namespace/name`.
    pub pod: String,
    pub uid: String,
    /// RFC 3339 (`2025-01-02T03:04:05Z`); compares in time order as text.
    pub created: String,
}

impl Origin {
    /// The origin of a pod as the API returns it.
    pub fn of_pod(pod: &Pod) -> Result<Self, Unusable> {
        let meta = &pod.metadata;
        let field = |value: Option<String>, name: &str| {
            value.ok_or_else(|| unusable(format!("pod has no metadata.{name}")))
        };
        Ok(Origin {
            pod: format!(
                "{}/{}",
                field(meta.namespace.clone(), "namespace")?,
                field(meta.name.clone(), "name")?
            ),
            uid: field(meta.uid.clone(), "uid")?,
            created: field(
                meta.creation_timestamp.as_ref().map(rfc3339),
                "creationTimestamp",
            )?,
        })
    }

    /// The origin recorded in a checkpoint's annotations.
    pub fn of_checkpoint(checkpoint: &Pod) -> Result<Self, Unusable> {
        let annotations = checkpoint.metadata.annotations.as_ref();
        let field = |name: &str| {
            annotations
                .and_then(|a| a.get(name))
                .cloned()
                .ok_or_else(|| unusable(format!("no annotation {name}")))
        };
        Ok(Origin {
            pod: field(OF)?,
            uid: field(OF_UID)?,
            created: field(OF_CREATED)?,
        })
    }
}

/// A time as the API writes it (`2025-01-02T03:04:05Z`, k8s-openapi's serialization of
/// [`Time`](k8s_openapi::apimachinery::pkg::apis::meta::v1::Time)).
fn rfc3339(t: &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time) -> String {
    t.0.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The static pod made of `pod` (as the API returns it). `retire_file` is given to the recovery
/// instance's proxy as `--retire-file`; `now` is the RFC 3339 time of writing. (A pod read
/// from the API's JSON comes through [`object::from_value`]: one with a field this build does
/// not know is no pod to make a checkpoint of.)
pub fn from_pod(pod: &Pod, retire_file: &str, now: &str) -> Result<Pod, Unusable> {
    let origin = Origin::of_pod(pod)?;
    let namespace = pod
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "kube-system".into());
    let mut spec = pod
        .spec
        .clone()
        .ok_or_else(|| unusable("pod has no spec"))?;
    strip_api_fields(&mut spec)?;
    let dropped = keep_volumes(&mut spec)?;
    adjust_containers(&mut spec, &dropped, retire_file)?;

    let labels = BTreeMap::from([
        ("component".to_owned(), NAME.to_owned()),
        ("tier".to_owned(), "control-plane".to_owned()),
    ]);
    let annotations = BTreeMap::from([
        (OF.to_owned(), origin.pod),
        (OF_UID.to_owned(), origin.uid),
        (OF_CREATED.to_owned(), origin.created),
        (AT.to_owned(), now.to_owned()),
    ]);
    Ok(Pod {
        metadata: ObjectMeta {
            name: Some(NAME.to_owned()),
            namespace: Some(namespace),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    })
}

/// A checkpoint as read from its file (JSON), as `recover` reads it before activating it: a v1
/// Pod with no field this build does not know (one written by a newer build is refused, not
/// activated without the field).
pub fn read(checkpoint: Value) -> Result<Pod, Unusable> {
    #[derive(serde::Deserialize)]
    struct Kind {
        #[serde(rename = "apiVersion")]
        api_version: Option<String>,
        kind: Option<String>,
    }
    let kind = <Kind as serde::Deserialize>::deserialize(&checkpoint).ok();
    if !kind
        .is_some_and(|k| k.api_version.as_deref() == Some("v1") && k.kind.as_deref() == Some("Pod"))
    {
        return Err(unusable("not a v1 Pod"));
    }
    object::from_value(checkpoint).map_err(|e| unusable(e.to_string()))
}

/// Clears the spec fields set by the scheduler, admission plugins or controllers, or
/// meaningless without an API (`nodeName`, `priority`, `preemptionPolicy`,
/// `serviceAccountName`, `serviceAccount`, `schedulerName`, `affinity`, `nodeSelector`,
/// `tolerations`, `topologySpreadConstraints`, `readinessGates`, `imagePullSecrets`,
/// `ephemeralContainers`, `overhead`, `resourceClaims`, `schedulingGates`); refuses a
/// `runtimeClassName`; turns the token automount off.
fn strip_api_fields(spec: &mut PodSpec) -> Result<(), Unusable> {
    spec.node_name = None;
    spec.priority = None;
    spec.preemption_policy = None;
    spec.service_account_name = None;
    spec.service_account = None;
    spec.scheduler_name = None;
    spec.affinity = None;
    spec.node_selector = None;
    spec.tolerations = None;
    spec.topology_spread_constraints = None;
    spec.readiness_gates = None;
    spec.image_pull_secrets = None;
    spec.ephemeral_containers = None;
    spec.overhead = None;
    spec.resource_claims = None;
    spec.scheduling_gates = None;
    if spec.runtime_class_name.is_some() {
        return Err(unusable(
            "spec.runtimeClassName needs the API (a RuntimeClass); a static pod cannot use it",
        ));
    }
    spec.automount_service_account_token = Some(false);
    Ok(())
}

/// The kind of a volume: the name of its source's field (`hostPath`, `secret`, …; the first by
/// name if it has several), empty if it has none.
fn volume_kind(v: &Volume) -> String {
    match object::to_value(v) {
        Value::Object(fields) => fields
            .keys()
            .find(|k| k.as_str() != "name")
            .cloned()
            .unwrap_or_default(),
        _ => String::new(),
    }
}

/// Keeps the volumes the kubelet can set up alone, drops service account tokens (their names
/// returned, for the mounts); any other volume makes the pod unusable.
fn keep_volumes(spec: &mut PodSpec) -> Result<Vec<String>, Unusable> {
    let mut dropped = Vec::new();
    let mut volumes = Vec::new();
    for v in spec.volumes.take().into_iter().flatten() {
        let name = v.name.clone();
        match volume_kind(&v).as_str() {
            "hostPath" | "emptyDir" | "downwardAPI" => volumes.push(v),
            "projected" => {
                let sources = v
                    .projected
                    .as_ref()
                    .and_then(|p| p.sources.as_deref())
                    .unwrap_or_default();
                if sources.iter().any(|s| s.service_account_token.is_some()) {
                    dropped.push(name);
                } else if sources.iter().all(|s| s.downward_api.is_some()) {
                    volumes.push(v);
                } else {
                    return Err(unusable(format!(
                        "volume {name} projects API objects; a static pod cannot use it"
                    )));
                }
            }
            other => {
                return Err(unusable(format!(
                    "volume {name} ({other}) needs the API; a static pod cannot use it"
                )))
            }
        }
    }
    spec.volumes = Some(volumes);
    Ok(dropped)
}

/// Checks every container's environment, drops the mounts of the `dropped` volumes and gives
/// the one proxy sidecar `--retire-file`.
fn adjust_containers(
    spec: &mut PodSpec,
    dropped: &[String],
    retire_file: &str,
) -> Result<(), Unusable> {
    let mut proxies = 0;
    let init = spec.init_containers.iter_mut().flatten();
    let main = spec.containers.iter_mut().map(|c| (true, c));
    for (main, c) in init.map(|c| (false, c)).chain(main) {
        check_env(c)?;
        if let Some(mounts) = &mut c.volume_mounts {
            mounts.retain(|m| !dropped.contains(&m.name));
        }
        if main && is_proxy(c) {
            proxies += 1;
            add_retire_file(c, retire_file);
        }
    }
    if proxies != 1 {
        return Err(unusable(format!(
            "{proxies} containers run with {PROXY_FLAG}; exactly one (the proxy sidecar) must"
        )));
    }
    Ok(())
}

/// Environment that needs the API makes the pod unusable.
fn check_env(c: &Container) -> Result<(), Unusable> {
    let container = &c.name;
    if c.env_from.as_ref().is_some_and(|a| !a.is_empty()) {
        return Err(unusable(format!(
            "container {container}: envFrom needs the API; a static pod cannot use it"
        )));
    }
    for e in c.env.iter().flatten() {
        let from = e.value_from.as_ref();
        if from.is_some_and(|f| f.secret_key_ref.is_some() || f.config_map_key_ref.is_some()) {
            return Err(unusable(format!(
                "container {container}: env {} comes from a Secret or ConfigMap; a static pod cannot use it",
                e.name
            )));
        }
    }
    Ok(())
}

fn is_proxy(c: &Container) -> bool {
    let flag = |a: &String| a == PROXY_FLAG || a.starts_with(&format!("{PROXY_FLAG}="));
    c.command.iter().flatten().any(flag)
        || c.args.iter().flatten().any(flag)
        || c.env.iter().flatten().any(|e| e.name == PROXY_ENV)
}

/// Adds `--retire-file` (replacing one the pod had).
fn add_retire_file(c: &mut Container, retire_file: &str) {
    for list in [&mut c.command, &mut c.args].into_iter().flatten() {
        list.retain(|a| !a.starts_with("--retire-file"));
    }
    c.args
        .get_or_insert_with(Vec::new)
        .push(format!("--retire-file={retire_file}"));
}

/// The host paths a checkpoint may always mount: kubeadm's certificate directories (those its
/// apiserver mounts) and the proxy's node directory. `recover --allow-host-path` adds to them.
pub const DEFAULT_HOST_PATHS: &[&str] = &[
    "/etc/kubernetes/pki",
    "/etc/ssl/certs",
    "/etc/ca-certificates",
    "/etc/pki",
    "/usr/share/ca-certificates",
    "/usr/local/share/ca-certificates",
    "/run/kube-apiserver-proxy",
];

/// kubeadm's static pod manifests: never mountable by a checkpoint, whatever the kubelet's
/// static pod directory is (with `kubeadm-sync` the kubelet runs copies of these).
pub const KUBEADM_MANIFESTS: &str = "/etc/kubernetes/manifests";

/// The image repositories a checkpoint may always run: kubeadm's kube-apiserver (its default
/// `imageRepository`). `recover --allow-image-repository` adds to them (the proxy's image, a
/// mirror).
pub const DEFAULT_IMAGE_REPOSITORIES: &[&str] = &["registry.k8s.io/kube-apiserver"];

/// What a checkpoint may hold: the rules applied when a pod is written as the checkpoint and
/// again before it is activated at boot (the kubelet runs what is activated as root, with no
/// admission in between).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// Host paths a volume may mount (the path itself or anything below it).
    pub host_paths: Vec<String>,
    /// Paths no volume may mount, nor anything above or below them, even when allowed: the
    /// checkpoint directory and the kubelet's static pod directory (a pod that can write either
    /// can make any pod a static pod).
    pub protected: Vec<String>,
    /// Image repositories (`registry/path`, without tag or digest) the containers may run; an
    /// entry ending in `/` allows every repository below it.
    pub image_repositories: Vec<String>,
    /// Capabilities a container may add (none by default; upper case, without `CAP_`).
    pub capabilities: Vec<String>,
}

impl Policy {
    /// The defaults plus `host_paths` and `image_repositories`; `protected` as given.
    pub fn new(host_paths: &[String], image_repositories: &[String], protected: &[String]) -> Self {
        let with_defaults = |defaults: &[&str], extra: &[String]| {
            let mut all: Vec<String> = defaults.iter().map(|s| s.to_string()).collect();
            for e in extra {
                if !all.contains(e) {
                    all.push(e.clone());
                }
            }
            all
        };
        Policy {
            host_paths: with_defaults(DEFAULT_HOST_PATHS, host_paths),
            protected: protected
                .iter()
                .map(|p| normalize(p).unwrap_or(p).to_owned())
                .collect(),
            image_repositories: with_defaults(DEFAULT_IMAGE_REPOSITORIES, image_repositories),
            capabilities: Vec::new(),
        }
    }

    /// Lets containers add these capabilities (`NET_RAW` or `CAP_NET_RAW`, any case).
    pub fn allow_capabilities(mut self, capabilities: &[String]) -> Self {
        self.capabilities = capabilities.iter().map(|c| capability_name(c)).collect();
        self
    }
}

/// `cap_net_raw`, `CAP_NET_RAW` and `NET_RAW` are `NET_RAW`.
fn capability_name(c: &str) -> String {
    let up = c.trim().to_ascii_uppercase();
    up.strip_prefix("CAP_").unwrap_or(&up).to_owned()
}

/// `path` without trailing slashes, if it is absolute and has no empty, `.` or `..` component
/// (`/` stays `/`).
pub fn normalize(path: &str) -> Option<&str> {
    if !path.is_empty() && path.bytes().all(|b| b == b'/') {
        return Some("/");
    }
    let p = path.trim_end_matches('/');
    let ok = p.starts_with('/')
        && p[1..]
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
    ok.then_some(p)
}

/// Whether `path` is `dir` or below it (both normalized).
fn within(path: &str, dir: &str) -> bool {
    dir == "/" || path == dir || path.starts_with(&format!("{dir}/"))
}

/// The repository of an image reference: without `@digest` and without `:tag` (a `:` before
/// the last `/` is a registry's port).
pub fn image_repository(image: &str) -> &str {
    let name = image.split('@').next().unwrap_or(image);
    match name.rfind(':') {
        Some(i) if !name[i..].contains('/') => &name[..i],
        _ => name,
    }
}

/// One container of a checkpoint against `policy` (`pod_seccomp`: the pod's own profile).
fn check_container(
    c: &Container,
    policy: &Policy,
    pod_seccomp: Option<&str>,
) -> Result<(), Unusable> {
    let name = &c.name;
    let security = c.security_context.as_ref();
    if security.and_then(|s| s.privileged) == Some(true) {
        return Err(unusable(format!("container {name} is privileged")));
    }
    let added: Vec<&str> = security
        .and_then(|s| s.capabilities.as_ref())
        .and_then(|c| c.add.as_ref())
        .into_iter()
        .flatten()
        .map(String::as_str)
        .filter(|c| !policy.capabilities.contains(&capability_name(c)))
        .collect();
    if !added.is_empty() {
        return Err(unusable(format!(
            "container {name} adds capabilities ({})",
            added.join(", ")
        )));
    }
    let image = c.image.as_deref().unwrap_or("");
    let repository = image_repository(image);
    let allowed = policy
        .image_repositories
        .iter()
        .any(|a| repository == a || (a.ends_with('/') && repository.starts_with(a.as_str())));
    if image.is_empty() || !allowed {
        return Err(unusable(format!(
            "container {name} runs image {image:?}, not from an allowed repository ({})",
            policy.image_repositories.join(", ")
        )));
    }
    let seccomp = security
        .and_then(|s| s.seccomp_profile.as_ref())
        .map(|p| p.type_.as_str());
    match seccomp.or(pod_seccomp) {
        Some("RuntimeDefault" | "Localhost") => {}
        Some(other) => {
            return Err(unusable(format!(
                "container {name} runs with seccomp profile {other}"
            )))
        }
        None => {
            return Err(unusable(format!(
                "container {name} has no seccomp profile (Unconfined unless the kubelet's seccompDefault is on); set RuntimeDefault"
            )))
        }
    }
    Ok(())
}

/// Checks a checkpoint against `policy`, when it is written and before it is given to the
/// kubelet (a file read with [`read`]): a pod named [`NAME`] carrying its origin; no host PID or
/// IPC namespace, no ephemeral container; in every container: not privileged, no added
/// capability (but those of `Policy::capabilities`), an image from an allowed repository, a
/// seccomp profile (`RuntimeDefault` or `Localhost`; unset is `Unconfined` on a kubelet without
/// `seccompDefault`); host paths only under the allowed ones and never over the protected ones.
/// The pod's spec is decided by anyone allowed to change the Deployment, and the kubelet runs
/// what is activated as root: the file is checked again at activation, whoever wrote it.
pub fn validate(checkpoint: &Pod, policy: &Policy) -> Result<Origin, Unusable> {
    if checkpoint.metadata.name.as_deref() != Some(NAME) {
        return Err(unusable(format!("metadata.name is not {NAME}")));
    }
    let origin = Origin::of_checkpoint(checkpoint)?;
    let Some(spec) = &checkpoint.spec else {
        return Ok(origin);
    };
    for (ns, set) in [("hostPID", spec.host_pid), ("hostIPC", spec.host_ipc)] {
        if set == Some(true) {
            return Err(unusable(format!("spec.{ns} is set")));
        }
    }
    if spec
        .ephemeral_containers
        .as_ref()
        .is_some_and(|a| !a.is_empty())
    {
        return Err(unusable("spec.ephemeralContainers is set"));
    }
    let pod_seccomp = spec
        .security_context
        .as_ref()
        .and_then(|s| s.seccomp_profile.as_ref())
        .map(|p| p.type_.as_str());
    for c in spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
    {
        check_container(c, policy, pod_seccomp)?;
    }
    for v in spec.volumes.iter().flatten() {
        let Some(path) = v.host_path.as_ref().map(|h| h.path.as_str()) else {
            continue;
        };
        let volume = &v.name;
        let Some(p) = normalize(path) else {
            return Err(unusable(format!(
                "volume {volume} mounts host path {path}, which is not a plain absolute path"
            )));
        };
        if let Some(dir) = policy
            .protected
            .iter()
            .find(|d| within(p, d) || within(d, p))
        {
            return Err(unusable(format!(
                "volume {volume} mounts host path {path}, which is or holds {dir}: a pod that can write there can make any pod a static pod"
            )));
        }
        let inside = policy
            .host_paths
            .iter()
            .filter_map(|a| normalize(a))
            .any(|a| within(p, a));
        if !inside {
            return Err(unusable(format!(
                "volume {volume} mounts host path {path}, not under an allowed path ({})",
                policy.host_paths.join(", ")
            )));
        }
    }
    Ok(origin)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{EnvVar, SecurityContext};
    use serde_json::json;

    /// The Deployment's pod as the API returns it (abridged to what matters here).
    fn pod() -> Pod {
        object::from_value(pod_json()).unwrap()
    }

    pub(crate) fn pod_json() -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "kube-apiserver-7d4f9c-abcde",
                "namespace": "kube-system",
                "uid": "1111-2222",
                "creationTimestamp": "2025-01-02T03:04:05Z",
                "labels": {"component": "kube-apiserver", "tier": "control-plane", "pod-template-hash": "7d4f9c"},
                "annotations": {"kubectl.kubernetes.io/restartedAt": "x"},
                "ownerReferences": [{"kind": "ReplicaSet", "name": "kube-apiserver-7d4f9c"}],
                "resourceVersion": "42"
            },
            "spec": {
                "nodeName": "node-1",
                "priority": 2000001000,
                "priorityClassName": "system-node-critical",
                "serviceAccountName": "kube-apiserver-proxy",
                "serviceAccount": "kube-apiserver-proxy",
                "automountServiceAccountToken": false,
                "hostNetwork": true,
                "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                "tolerations": [{"operator": "Exists"}],
                "affinity": {"podAntiAffinity": {}},
                "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
                "schedulerName": "default-scheduler",
                "initContainers": [{"name": "install-proxy", "image": "proxy:1",
                    "command": ["/kube-apiserver-proxy", "install", "/proxy-bin/kube-apiserver-proxy"],
                    "volumeMounts": [{"name": "proxy-bin", "mountPath": "/proxy-bin"}]}],
                "containers": [
                    {"name": "kube-apiserver", "image": "kube-apiserver:v1",
                     "command": ["/proxy-bin/kube-apiserver-proxy", "launch", "--address-file=/shared/address", "--", "kube-apiserver"],
                     "args": ["--bind-address={{address}}", "--etcd-servers=https://127.0.0.1:2379"],
                     "env": [{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
                     "volumeMounts": [{"name": "shared", "mountPath": "/shared"}, {"name": "k8s-certs", "mountPath": "/etc/kubernetes/pki"}]},
                    {"name": "proxy", "image": "proxy:1",
                     "command": ["/kube-apiserver-proxy", "run"],
                     "args": ["--listen=$(HOST_IP):6443", "--handoff-dir=/run/kube-apiserver-proxy/handoff",
                              "--drain-timeout=45s"],
                     "env": [{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}],
                     "volumeMounts": [{"name": "shared", "mountPath": "/shared"},
                                      {"name": "kube-api-access", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": true},
                                      {"name": "proxy-run", "mountPath": "/run/kube-apiserver-proxy"}]}
                ],
                "volumes": [
                    {"name": "proxy-bin", "emptyDir": {}},
                    {"name": "shared", "emptyDir": {"medium": "Memory"}},
                    {"name": "k8s-certs", "hostPath": {"path": "/etc/kubernetes/pki", "type": "Directory"}},
                    {"name": "proxy-run", "hostPath": {"path": "/run/kube-apiserver-proxy", "type": "Directory"}},
                    {"name": "kube-api-access", "projected": {"sources": [{"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}, {"configMap": {"name": "kube-root-ca.crt"}}]}}
                ]
            },
            "status": {"phase": "Running"}
        })
    }

    const RETIRE: &str = "/run/kube-apiserver-proxy/checkpoint-retire";

    /// The agent's policy for the test pod's images, with the manifests' directories protected.
    pub(crate) fn policy() -> Policy {
        Policy::new(
            &[],
            &["proxy".into(), "kube-apiserver".into()],
            &[
                "/var/lib/kube-apiserver-proxy/checkpoint".into(),
                "/etc/kubernetes/manifests/".into(),
            ],
        )
    }

    fn container<'a>(pod: &'a Pod, name: &str) -> &'a Container {
        pod.spec
            .as_ref()
            .unwrap()
            .containers
            .iter()
            .find(|c| c.name == name)
            .unwrap()
    }

    fn spec(pod: &mut Pod) -> &mut PodSpec {
        pod.spec.as_mut().unwrap()
    }

    /// The path of the test pod's `k8s-certs` volume.
    fn host_path(pod: &mut Pod) -> &mut String {
        &mut spec(pod).volumes.as_mut().unwrap()[2]
            .host_path
            .as_mut()
            .unwrap()
            .path
    }

    fn security(context: Value) -> Option<SecurityContext> {
        Some(object::typed(context, "securityContext").unwrap())
    }

    fn annotation<'a>(pod: &'a Pod, name: &str) -> Option<&'a str> {
        object::annotation(&pod.metadata, name)
    }

    #[test]
    fn pod_becomes_a_static_pod_of_its_own() {
        let s = from_pod(&pod(), RETIRE, "2025-01-02T04:00:00Z").unwrap();
        assert_eq!(s.metadata.name.as_deref(), Some(NAME));
        assert_eq!(s.metadata.namespace.as_deref(), Some("kube-system"));
        // Never the Deployment's labels: its selector must not match the mirror pod.
        assert_eq!(
            s.metadata.labels,
            Some(BTreeMap::from([
                ("component".into(), NAME.into()),
                ("tier".into(), "control-plane".into())
            ]))
        );
        assert_eq!(
            annotation(&s, OF),
            Some("kube-system/kube-apiserver-7d4f9c-abcde")
        );
        assert_eq!(annotation(&s, OF_UID), Some("1111-2222"));
        assert_eq!(annotation(&s, OF_CREATED), Some("2025-01-02T03:04:05Z"));
        assert_eq!(annotation(&s, AT), Some("2025-01-02T04:00:00Z"));
        assert!(s.metadata.owner_references.is_none());
        assert!(s.metadata.resource_version.is_none());
        assert!(s.metadata.uid.is_none());
        assert!(s.status.is_none());
        let spec = s.spec.as_ref().unwrap();
        assert!(spec.node_name.is_none(), "nodeName kept");
        assert!(spec.priority.is_none(), "priority kept");
        assert!(
            spec.service_account_name.is_none(),
            "serviceAccountName kept"
        );
        assert!(spec.service_account.is_none(), "serviceAccount kept");
        assert!(spec.tolerations.is_none(), "tolerations kept");
        assert!(spec.affinity.is_none(), "affinity kept");
        assert!(spec.node_selector.is_none(), "nodeSelector kept");
        assert!(spec.scheduler_name.is_none(), "schedulerName kept");
        assert_eq!(
            spec.priority_class_name.as_deref(),
            Some("system-node-critical")
        );
        assert_eq!(spec.host_network, Some(true));
        assert_eq!(spec.automount_service_account_token, Some(false));
        let volumes: Vec<&str> = spec
            .volumes
            .iter()
            .flatten()
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(volumes, ["proxy-bin", "shared", "k8s-certs", "proxy-run"]);
        assert_eq!(
            spec.init_containers.as_ref().unwrap()[0].name,
            "install-proxy"
        );
    }

    #[test]
    fn the_apiserver_is_kept_as_it_ran() {
        let s = from_pod(&pod(), RETIRE, "t").unwrap();
        assert_eq!(
            container(&s, "kube-apiserver"),
            container(&pod(), "kube-apiserver")
        );
    }

    #[test]
    fn the_proxy_becomes_a_recovery_instance() {
        let s = from_pod(&pod(), RETIRE, "t").unwrap();
        let proxy = container(&s, "proxy");
        assert_eq!(
            proxy.args.as_deref().unwrap(),
            [
                "--listen=$(HOST_IP):6443".to_owned(),
                "--handoff-dir=/run/kube-apiserver-proxy/handoff".into(),
                "--drain-timeout=45s".into(),
                format!("--retire-file={RETIRE}")
            ]
        );
        let env: Vec<EnvVar> = object::typed(
            json!([{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}]),
            "env",
        )
        .unwrap();
        assert_eq!(proxy.env.as_ref(), Some(&env));
        let mounts: Vec<&str> = proxy
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.name.as_str())
            .collect();
        assert_eq!(mounts, ["shared", "proxy-run"]);
        // What it makes passes the checks `recover` makes before activating it, also as the
        // file it is written as.
        let origin = validate(&s, &policy()).unwrap();
        assert_eq!(origin, Origin::of_pod(&pod()).unwrap());
        let file = serde_json::to_vec_pretty(&s).unwrap();
        let read_back = read(serde_json::from_slice(&file).unwrap()).unwrap();
        assert_eq!(read_back, s);
    }

    #[test]
    fn api_objects_make_a_pod_unusable() {
        let mut p = pod();
        spec(&mut p).volumes.as_mut().unwrap().push(
            object::typed(
                json!({"name": "enc", "secret": {"secretName": "enc"}}),
                "volume",
            )
            .unwrap(),
        );
        let e = from_pod(&p, RETIRE, "t").unwrap_err();
        assert!(e.0.contains("volume enc (secret)"), "{e}");

        let mut p = pod();
        spec(&mut p).containers[0].env.as_mut().unwrap().push(
            object::typed(
                json!({"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}),
                "env",
            )
            .unwrap(),
        );
        let e = from_pod(&p, RETIRE, "t").unwrap_err();
        assert!(e.0.contains("env X"), "{e}");

        let mut p = pod();
        spec(&mut p).containers[1].args = Some(vec!["--listen=x:1".into()]);
        let e = from_pod(&p, RETIRE, "t").unwrap_err();
        assert!(e.0.contains("0 containers run with --handoff-dir"), "{e}");
    }

    /// A pod from a newer API, with a field this build does not know, is not made a
    /// checkpoint without it; nor is a checkpoint file with one activated.
    #[test]
    fn a_field_this_build_does_not_know_is_never_dropped() {
        let good = object::to_value(&from_pod(&pod(), RETIRE, "t").unwrap());
        assert!(read(good.clone()).is_ok());
        let mut file = good.clone();
        file["spec"]["hostNetworkFuture"] = json!("x");
        let e = read(file).unwrap_err();
        assert!(e.0.contains("(spec.hostNetworkFuture;"), "{e}");
        for (key, value) in [("apiVersion", json!("v2")), ("kind", json!("Pod2"))] {
            let mut file = good.clone();
            file[key] = value;
            assert_eq!(read(file).unwrap_err().0, "not a v1 Pod");
            let mut file = good.clone();
            file.as_object_mut().unwrap().remove(key);
            assert_eq!(read(file).unwrap_err().0, "not a v1 Pod");
        }
        assert_eq!(read(json!([])).unwrap_err().0, "not a v1 Pod");
    }

    #[test]
    fn validation_refuses_what_an_apiserver_pod_does_not_need() {
        let policy = policy();
        let good = from_pod(&pod(), RETIRE, "t").unwrap();
        assert!(validate(&good, &policy).is_ok());
        type Break = fn(&mut Pod);
        let cases: [(&str, &str, Break); 20] = [
            (
                "host path /",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| *host_path(s) = "/".into(),
            ),
            ("a path with ..", "not a plain absolute path", |s| {
                *host_path(s) = "/etc/kubernetes/pki/../..".into()
            }),
            ("a relative path", "not a plain absolute path", |s| {
                *host_path(s) = "etc/kubernetes/pki".into()
            }),
            ("host path /var/log", "not under an allowed path", |s| {
                *host_path(s) = "/var/log".into()
            }),
            // A sibling directory with a common prefix is not "under" an allowed path.
            ("a sibling", "not under an allowed path", |s| {
                *host_path(s) = "/etc/kubernetes/pki-other".into()
            }),
            (
                "the checkpoint directory",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| *host_path(s) = "/var/lib/kube-apiserver-proxy/checkpoint".into(),
            ),
            (
                "a parent of it",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| *host_path(s) = "/var/lib/".into(),
            ),
            (
                "a file in it",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| {
                    *host_path(s) =
                        "/var/lib/kube-apiserver-proxy/checkpoint/kube-apiserver.json".into()
                },
            ),
            (
                "the static pod directory",
                "holds /etc/kubernetes/manifests",
                |s| *host_path(s) = "/etc/kubernetes".into(),
            ),
            ("privileged", "is privileged", |s| {
                spec(s).containers[0].security_context = security(json!({"privileged": true}))
            }),
            (
                "an added capability",
                "adds capabilities (SYS_ADMIN)",
                |s| {
                    spec(s).containers[1].security_context =
                        security(json!({"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}}))
                },
            ),
            (
                "an init container's capability",
                "container install-proxy adds",
                |s| {
                    spec(s).init_containers.as_mut().unwrap()[0].security_context =
                        security(json!({"capabilities": {"add": ["NET_ADMIN"]}}))
                },
            ),
            (
                "an image of another repository",
                "runs image \"evil.example/kube-apiserver:v1\"",
                |s| spec(s).containers[0].image = Some("evil.example/kube-apiserver:v1".into()),
            ),
            (
                "a repository with an allowed prefix",
                "not from an allowed repository",
                |s| spec(s).containers[1].image = Some("proxy-evil:1".into()),
            ),
            ("no image", "runs image \"\"", |s| {
                spec(s).containers[1].image = None
            }),
            (
                "seccomp Unconfined (pod)",
                "seccomp profile Unconfined",
                |s| {
                    spec(s).security_context =
                        security_of_pod(json!({"seccompProfile": {"type": "Unconfined"}}))
                },
            ),
            (
                "seccomp Unconfined (container)",
                "seccomp profile Unconfined",
                |s| {
                    spec(s).containers[0].security_context =
                        security(json!({"seccompProfile": {"type": "Unconfined"}}))
                },
            ),
            ("no seccomp profile", "no seccomp profile", |s| {
                spec(s).security_context = None
            }),
            ("hostPID", "spec.hostPID", |s| spec(s).host_pid = Some(true)),
            ("name", "metadata.name", |s| {
                s.metadata.name = Some("other".into())
            }),
        ];
        for (what, why, break_it) in cases {
            let mut s = good.clone();
            break_it(&mut s);
            match validate(&s, &policy) {
                Ok(_) => panic!("{what} accepted"),
                Err(e) => assert!(e.0.contains(why), "{what}: {e}"),
            }
        }
        // A container may tighten the pod's profile, and images by tag or digest (a registry
        // with a port) name their repository.
        let mut s = good.clone();
        spec(&mut s).containers[0].security_context = security(
            json!({"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}}),
        );
        spec(&mut s).containers[0].image = Some("kube-apiserver@sha256:abcd".into());
        assert!(validate(&s, &policy).is_ok());
        let mirror = Policy::new(&[], &["registry.example:5000/mirror/".into()], &[]);
        spec(&mut s).containers[0].image =
            Some("registry.example:5000/mirror/kube-apiserver:v1.37.2".into());
        spec(&mut s).containers[1].image = Some("registry.example:5000/mirror/proxy:1".into());
        spec(&mut s).init_containers.as_mut().unwrap()[0].image =
            Some("registry.example:5000/mirror/proxy:1".into());
        assert!(validate(&s, &mirror).is_ok());
        // Capabilities only as allowed by name.
        let mut s = good.clone();
        spec(&mut s).containers[1].security_context =
            security(json!({"capabilities": {"drop": ["ALL"], "add": ["NET_RAW", "CAP_SETUID"]}}));
        assert!(validate(&s, &policy).is_err());
        let some = policy.clone().allow_capabilities(&["net_raw".into()]);
        let e = validate(&s, &some).unwrap_err();
        assert!(e.0.ends_with("adds capabilities (CAP_SETUID)"), "{e}");
        let both = policy.allow_capabilities(&["CAP_NET_RAW".into(), "SETUID".into()]);
        assert!(validate(&s, &both).is_ok());
    }

    fn security_of_pod(context: Value) -> Option<k8s_openapi::api::core::v1::PodSecurityContext> {
        Some(object::typed(context, "securityContext").unwrap())
    }

    #[test]
    fn allowed_host_paths_and_repositories_add_to_the_defaults() {
        let p = Policy::new(
            &["/var/log/kubernetes/audit".into()],
            &["ghcr.io/example/kube-apiserver-proxy".into()],
            &[],
        );
        for d in DEFAULT_HOST_PATHS {
            assert!(p.host_paths.iter().any(|h| h == d), "{d} dropped");
        }
        assert!(p
            .host_paths
            .iter()
            .any(|h| h == "/var/log/kubernetes/audit"));
        assert_eq!(
            p.image_repositories,
            [
                "registry.k8s.io/kube-apiserver",
                "ghcr.io/example/kube-apiserver-proxy"
            ]
        );
        assert_eq!(
            image_repository("registry.k8s.io/kube-apiserver:v1.37.2"),
            "registry.k8s.io/kube-apiserver"
        );
        assert_eq!(image_repository("localhost:5000/a/b"), "localhost:5000/a/b");
        assert_eq!(
            image_repository("localhost:5000/a/b:1@sha256:00"),
            "localhost:5000/a/b"
        );
    }

    #[test]
    fn a_retire_file_the_pod_had_is_replaced() {
        let mut p = pod();
        spec(&mut p).containers[1]
            .args
            .as_mut()
            .unwrap()
            .push("--retire-file=/elsewhere".into());
        let s = from_pod(&p, RETIRE, "t").unwrap();
        let args = container(&s, "proxy").args.clone().unwrap();
        assert!(!args.iter().any(|a| a.contains("/elsewhere")), "{args:?}");
        assert_eq!(
            args.iter()
                .filter(|a| a.starts_with("--retire-file"))
                .count(),
            1,
            "{args:?}"
        );
    }
}
