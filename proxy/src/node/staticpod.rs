//! The checkpoint of an apiserver pod as a static pod: the pure transformation applied to the pod
//! before it is written ([`crate::node::checkpoint`]), and the checks ([`Policy`], [`validate`]) made
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

use serde_json::{json, Map, Value};

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
    pub fn of_pod(pod: &Value) -> Result<Self, Unusable> {
        let meta = &pod["metadata"];
        let field = |name: &str| {
            meta[name]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| unusable(format!("pod has no metadata.{name}")))
        };
        Ok(Origin {
            pod: format!("{}/{}", field("namespace")?, field("name")?),
            uid: field("uid")?,
            created: field("creationTimestamp")?,
        })
    }

    /// The origin recorded in a checkpoint's annotations.
    pub fn of_checkpoint(checkpoint: &Value) -> Result<Self, Unusable> {
        let annotations = &checkpoint["metadata"]["annotations"];
        let field = |name: &str| {
            annotations[name]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| unusable(format!("no annotation {name}")))
        };
        Ok(Origin {
            pod: field(OF)?,
            uid: field(OF_UID)?,
            created: field(OF_CREATED)?,
        })
    }
}

/// The static pod made of `pod` (as the API returns it). `retire_file` is given to the recovery
/// instance's proxy as `--retire-file`; `now` is the RFC 3339 time of writing.
pub fn from_pod(pod: &Value, retire_file: &str, now: &str) -> Result<Value, Unusable> {
    let origin = Origin::of_pod(pod)?;
    let namespace = pod["metadata"]["namespace"]
        .as_str()
        .unwrap_or("kube-system");
    let mut spec = pod["spec"]
        .as_object()
        .cloned()
        .ok_or_else(|| unusable("pod has no spec"))?;
    strip_api_fields(&mut spec)?;
    let dropped = keep_volumes(&mut spec)?;
    adjust_containers(&mut spec, &dropped, retire_file)?;

    let mut labels = Map::new();
    labels.insert("component".into(), json!(NAME));
    labels.insert("tier".into(), json!("control-plane"));
    let mut annotations = Map::new();
    annotations.insert(OF.into(), json!(origin.pod));
    annotations.insert(OF_UID.into(), json!(origin.uid));
    annotations.insert(OF_CREATED.into(), json!(origin.created));
    annotations.insert(AT.into(), json!(now));
    Ok(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": NAME,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
        },
        "spec": spec,
    }))
}

/// Spec fields set by the scheduler, admission plugins or controllers, or meaningless without
/// an API: dropped.
const API_FIELDS: &[&str] = &[
    "nodeName",
    "priority",
    "preemptionPolicy",
    "serviceAccountName",
    "serviceAccount",
    "schedulerName",
    "affinity",
    "nodeSelector",
    "tolerations",
    "topologySpreadConstraints",
    "readinessGates",
    "imagePullSecrets",
    "ephemeralContainers",
    "overhead",
    "resourceClaims",
    "schedulingGates",
];

/// Drops [`API_FIELDS`], refuses a `runtimeClassName`, turns the token automount off.
fn strip_api_fields(spec: &mut Map<String, Value>) -> Result<(), Unusable> {
    for field in API_FIELDS {
        spec.remove(*field);
    }
    if spec.contains_key("runtimeClassName") {
        return Err(unusable(
            "spec.runtimeClassName needs the API (a RuntimeClass); a static pod cannot use it",
        ));
    }
    spec.insert("automountServiceAccountToken".into(), Value::Bool(false));
    Ok(())
}

/// Keeps the volumes the kubelet can set up alone, drops service account tokens (their names
/// returned, for the mounts); any other volume makes the pod unusable.
fn keep_volumes(spec: &mut Map<String, Value>) -> Result<Vec<String>, Unusable> {
    let mut dropped = Vec::new();
    let mut volumes = Vec::new();
    for v in spec
        .get("volumes")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let name = v["name"].as_str().unwrap_or("?").to_owned();
        let obj = v.as_object().cloned().unwrap_or_default();
        let kind = obj
            .keys()
            .find(|k| k.as_str() != "name")
            .cloned()
            .unwrap_or_default();
        match kind.as_str() {
            "hostPath" | "emptyDir" | "downwardAPI" => volumes.push(v.clone()),
            "projected" => {
                let sources = v["projected"]["sources"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                if sources
                    .iter()
                    .any(|s| s.get("serviceAccountToken").is_some())
                {
                    dropped.push(name);
                } else if sources.iter().all(|s| s.get("downwardAPI").is_some()) {
                    volumes.push(v.clone());
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
    spec.insert("volumes".into(), Value::Array(volumes));
    Ok(dropped)
}

/// Checks every container's environment, drops the mounts of the `dropped` volumes and gives
/// the one proxy sidecar `--retire-file`.
fn adjust_containers(
    spec: &mut Map<String, Value>,
    dropped: &[String],
    retire_file: &str,
) -> Result<(), Unusable> {
    let mut proxies = 0;
    for list in ["initContainers", "containers"] {
        let Some(containers) = spec.get_mut(list).and_then(Value::as_array_mut) else {
            continue;
        };
        for c in containers.iter_mut() {
            let c = c
                .as_object_mut()
                .ok_or_else(|| unusable(format!("{list}: not an object")))?;
            let cname = c
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_owned();
            check_env(&cname, c)?;
            if let Some(mounts) = c.get_mut("volumeMounts").and_then(Value::as_array_mut) {
                mounts.retain(|m| {
                    !dropped
                        .iter()
                        .any(|d| m["name"].as_str() == Some(d.as_str()))
                });
            }
            if list == "containers" && is_proxy(c) {
                proxies += 1;
                add_retire_file(c, retire_file);
            }
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
fn check_env(container: &str, c: &Map<String, Value>) -> Result<(), Unusable> {
    if c.get("envFrom")
        .and_then(Value::as_array)
        .is_some_and(|a| !a.is_empty())
    {
        return Err(unusable(format!(
            "container {container}: envFrom needs the API; a static pod cannot use it"
        )));
    }
    for e in c.get("env").and_then(Value::as_array).into_iter().flatten() {
        let from = &e["valueFrom"];
        if from.get("secretKeyRef").is_some() || from.get("configMapKeyRef").is_some() {
            return Err(unusable(format!(
                "container {container}: env {} comes from a Secret or ConfigMap; a static pod cannot use it",
                e["name"].as_str().unwrap_or("?")
            )));
        }
    }
    Ok(())
}

fn string_list(c: &Map<String, Value>, key: &str) -> Vec<String> {
    c.get(key)
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect()
}

fn is_proxy(c: &Map<String, Value>) -> bool {
    let flag = |a: &String| a == PROXY_FLAG || a.starts_with(&format!("{PROXY_FLAG}="));
    string_list(c, "command").iter().any(flag)
        || string_list(c, "args").iter().any(flag)
        || c.get("env")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .any(|e| e["name"].as_str() == Some(PROXY_ENV))
}

/// Adds `--retire-file` (replacing one the pod had).
fn add_retire_file(c: &mut Map<String, Value>, retire_file: &str) {
    for key in ["command", "args"] {
        if c.contains_key(key) {
            let list: Vec<String> = string_list(c, key)
                .into_iter()
                .filter(|a| !a.starts_with("--retire-file"))
                .collect();
            c.insert(key.into(), json!(list));
        }
    }
    let mut args = string_list(c, "args");
    args.push(format!("--retire-file={retire_file}"));
    c.insert("args".into(), json!(args));
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

/// The mode of every static pod manifest and checkpoint written here: kubeadm's
/// (`WriteStaticPodToDisk` in `cmd/kubeadm/app/util/staticpod`). Only root reads them: the
/// kubelet, `kubeadm`, and `recover` (root, `CAP_DAC_OVERRIDE`).
pub const MANIFEST_MODE: u32 = 0o600;

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
fn check_container(c: &Value, policy: &Policy, pod_seccomp: Option<&str>) -> Result<(), Unusable> {
    let name = c["name"].as_str().unwrap_or("?");
    let security = &c["securityContext"];
    if security["privileged"] == true {
        return Err(unusable(format!("container {name} is privileged")));
    }
    let added: Vec<&str> = security["capabilities"]["add"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| c.as_str().unwrap_or("?"))
        .filter(|c| !policy.capabilities.contains(&capability_name(c)))
        .collect();
    if !added.is_empty() {
        return Err(unusable(format!(
            "container {name} adds capabilities ({})",
            added.join(", ")
        )));
    }
    let image = c["image"].as_str().unwrap_or("");
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
    match security["seccompProfile"]["type"].as_str().or(pod_seccomp) {
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
/// kubelet: a pod named [`NAME`] carrying its origin; no host PID or IPC namespace, no
/// ephemeral container; in every container: not privileged, no added capability (but those of
/// `Policy::capabilities`), an image from an allowed repository, a seccomp profile
/// (`RuntimeDefault` or `Localhost`; unset is `Unconfined` on a kubelet without
/// `seccompDefault`); host paths only under the allowed ones and never over the protected ones.
/// The pod's spec is decided by anyone allowed to change the Deployment, and the kubelet runs
/// what is activated as root: the file is checked again at activation, whoever wrote it.
pub fn validate(checkpoint: &Value, policy: &Policy) -> Result<Origin, Unusable> {
    if checkpoint["apiVersion"] != "v1" || checkpoint["kind"] != "Pod" {
        return Err(unusable("not a v1 Pod"));
    }
    if checkpoint["metadata"]["name"] != NAME {
        return Err(unusable(format!("metadata.name is not {NAME}")));
    }
    let origin = Origin::of_checkpoint(checkpoint)?;
    let spec = &checkpoint["spec"];
    for ns in ["hostPID", "hostIPC"] {
        if spec[ns] == true {
            return Err(unusable(format!("spec.{ns} is set")));
        }
    }
    if spec["ephemeralContainers"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
    {
        return Err(unusable("spec.ephemeralContainers is set"));
    }
    let pod_seccomp = spec["securityContext"]["seccompProfile"]["type"].as_str();
    for list in ["initContainers", "containers"] {
        for c in spec[list].as_array().into_iter().flatten() {
            check_container(c, policy, pod_seccomp)?;
        }
    }
    for v in spec["volumes"].as_array().into_iter().flatten() {
        let Some(path) = v["hostPath"]["path"].as_str() else {
            continue;
        };
        let volume = v["name"].as_str().unwrap_or("?");
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
mod tests {
    use super::*;

    /// The Deployment's pod as the API returns it (abridged to what matters here).
    fn pod() -> Value {
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
    fn policy() -> Policy {
        Policy::new(
            &[],
            &["proxy".into(), "kube-apiserver".into()],
            &[
                "/var/lib/kube-apiserver-proxy/checkpoint".into(),
                "/etc/kubernetes/manifests/".into(),
            ],
        )
    }

    fn container<'a>(pod: &'a Value, name: &str) -> &'a Value {
        pod["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
    }

    #[test]
    fn pod_becomes_a_static_pod_of_its_own() {
        let s = from_pod(&pod(), RETIRE, "2025-01-02T04:00:00Z").unwrap();
        assert_eq!(s["metadata"]["name"], NAME);
        assert_eq!(s["metadata"]["namespace"], "kube-system");
        // Never the Deployment's labels: its selector must not match the mirror pod.
        assert_eq!(
            s["metadata"]["labels"],
            json!({"component": NAME, "tier": "control-plane"})
        );
        assert_eq!(
            s["metadata"]["annotations"][OF],
            "kube-system/kube-apiserver-7d4f9c-abcde"
        );
        assert_eq!(s["metadata"]["annotations"][OF_UID], "1111-2222");
        assert_eq!(s["metadata"]["annotations"][AT], "2025-01-02T04:00:00Z");
        for gone in ["ownerReferences", "resourceVersion", "uid"] {
            assert!(s["metadata"].get(gone).is_none(), "{gone}");
        }
        assert!(s.get("status").is_none());
        let spec = &s["spec"];
        for gone in [
            "nodeName",
            "priority",
            "serviceAccountName",
            "serviceAccount",
            "tolerations",
            "affinity",
            "nodeSelector",
            "schedulerName",
        ] {
            assert!(spec.get(gone).is_none(), "{gone} kept");
        }
        assert_eq!(spec["priorityClassName"], "system-node-critical");
        assert_eq!(spec["hostNetwork"], true);
        assert_eq!(spec["automountServiceAccountToken"], false);
        let volumes: Vec<&str> = spec["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v["name"].as_str().unwrap())
            .collect();
        assert_eq!(volumes, ["proxy-bin", "shared", "k8s-certs", "proxy-run"]);
        assert_eq!(spec["initContainers"][0]["name"], "install-proxy");
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
            proxy["args"],
            json!([
                "--listen=$(HOST_IP):6443",
                "--handoff-dir=/run/kube-apiserver-proxy/handoff",
                "--drain-timeout=45s",
                format!("--retire-file={RETIRE}")
            ])
        );
        assert_eq!(
            proxy["env"],
            json!([{"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}])
        );
        let mounts: Vec<&str> = proxy["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["name"].as_str().unwrap())
            .collect();
        assert_eq!(mounts, ["shared", "proxy-run"]);
        // What it makes passes the checks `recover` makes before activating it.
        let origin = validate(&s, &policy()).unwrap();
        assert_eq!(origin, Origin::of_pod(&pod()).unwrap());
    }

    #[test]
    fn api_objects_make_a_pod_unusable() {
        let mut p = pod();
        p["spec"]["volumes"]
            .as_array_mut()
            .unwrap()
            .push(json!({"name": "enc", "secret": {"secretName": "enc"}}));
        let e = from_pod(&p, RETIRE, "t").unwrap_err();
        assert!(e.0.contains("volume enc (secret)"), "{e}");

        let mut p = pod();
        p["spec"]["containers"][0]["env"]
            .as_array_mut()
            .unwrap()
            .push(
                json!({"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}}),
            );
        let e = from_pod(&p, RETIRE, "t").unwrap_err();
        assert!(e.0.contains("env X"), "{e}");

        let mut p = pod();
        p["spec"]["containers"][1]["args"] = json!(["--listen=x:1"]);
        let e = from_pod(&p, RETIRE, "t").unwrap_err();
        assert!(e.0.contains("0 containers run with --handoff-dir"), "{e}");
    }

    #[test]
    fn validation_refuses_what_an_apiserver_pod_does_not_need() {
        let policy = policy();
        let good = from_pod(&pod(), RETIRE, "t").unwrap();
        assert!(validate(&good, &policy).is_ok());
        type Break = fn(&mut Value);
        let cases: [(&str, &str, Break); 20] = [
            (
                "host path /",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/"),
            ),
            ("a path with ..", "not a plain absolute path", |s| {
                s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/etc/kubernetes/pki/../..")
            }),
            ("a relative path", "not a plain absolute path", |s| {
                s["spec"]["volumes"][2]["hostPath"]["path"] = json!("etc/kubernetes/pki")
            }),
            ("host path /var/log", "not under an allowed path", |s| {
                s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/var/log")
            }),
            // A sibling directory with a common prefix is not "under" an allowed path.
            ("a sibling", "not under an allowed path", |s| {
                s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/etc/kubernetes/pki-other")
            }),
            (
                "the checkpoint directory",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| {
                    s["spec"]["volumes"][2]["hostPath"]["path"] =
                        json!("/var/lib/kube-apiserver-proxy/checkpoint")
                },
            ),
            (
                "a parent of it",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/var/lib/"),
            ),
            (
                "a file in it",
                "holds /var/lib/kube-apiserver-proxy/checkpoint",
                |s| {
                    s["spec"]["volumes"][2]["hostPath"]["path"] =
                        json!("/var/lib/kube-apiserver-proxy/checkpoint/kube-apiserver.json")
                },
            ),
            (
                "the static pod directory",
                "holds /etc/kubernetes/manifests",
                |s| s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/etc/kubernetes"),
            ),
            ("privileged", "is privileged", |s| {
                s["spec"]["containers"][0]["securityContext"] = json!({"privileged": true})
            }),
            (
                "an added capability",
                "adds capabilities (SYS_ADMIN)",
                |s| {
                    s["spec"]["containers"][1]["securityContext"] =
                        json!({"capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN"]}})
                },
            ),
            (
                "an init container's capability",
                "container install-proxy adds",
                |s| {
                    s["spec"]["initContainers"][0]["securityContext"] =
                        json!({"capabilities": {"add": ["NET_ADMIN"]}})
                },
            ),
            (
                "an image of another repository",
                "runs image \"evil.example/kube-apiserver:v1\"",
                |s| s["spec"]["containers"][0]["image"] = json!("evil.example/kube-apiserver:v1"),
            ),
            (
                "a repository with an allowed prefix",
                "not from an allowed repository",
                |s| s["spec"]["containers"][1]["image"] = json!("proxy-evil:1"),
            ),
            ("no image", "runs image \"\"", |s| {
                s["spec"]["containers"][1]
                    .as_object_mut()
                    .unwrap()
                    .remove("image");
            }),
            (
                "seccomp Unconfined (pod)",
                "seccomp profile Unconfined",
                |s| s["spec"]["securityContext"]["seccompProfile"]["type"] = json!("Unconfined"),
            ),
            (
                "seccomp Unconfined (container)",
                "seccomp profile Unconfined",
                |s| {
                    s["spec"]["containers"][0]["securityContext"] =
                        json!({"seccompProfile": {"type": "Unconfined"}})
                },
            ),
            ("no seccomp profile", "no seccomp profile", |s| {
                s["spec"].as_object_mut().unwrap().remove("securityContext");
            }),
            ("hostPID", "spec.hostPID", |s| {
                s["spec"]["hostPID"] = json!(true)
            }),
            ("name", "metadata.name", |s| {
                s["metadata"]["name"] = json!("other")
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
        s["spec"]["containers"][0]["securityContext"] =
            json!({"seccompProfile": {"type": "Localhost", "localhostProfile": "p.json"}});
        s["spec"]["containers"][0]["image"] = json!("kube-apiserver@sha256:abcd");
        assert!(validate(&s, &policy).is_ok());
        let mirror = Policy::new(&[], &["registry.example:5000/mirror/".into()], &[]);
        s["spec"]["containers"][0]["image"] =
            json!("registry.example:5000/mirror/kube-apiserver:v1.37.2");
        s["spec"]["containers"][1]["image"] = json!("registry.example:5000/mirror/proxy:1");
        s["spec"]["initContainers"][0]["image"] = json!("registry.example:5000/mirror/proxy:1");
        assert!(validate(&s, &mirror).is_ok());
        // Capabilities only as allowed by name.
        let mut s = good.clone();
        s["spec"]["containers"][1]["securityContext"] =
            json!({"capabilities": {"drop": ["ALL"], "add": ["NET_RAW", "CAP_SETUID"]}});
        assert!(validate(&s, &policy).is_err());
        let some = policy.clone().allow_capabilities(&["net_raw".into()]);
        let e = validate(&s, &some).unwrap_err();
        assert!(e.0.ends_with("adds capabilities (CAP_SETUID)"), "{e}");
        let both = policy.allow_capabilities(&["CAP_NET_RAW".into(), "SETUID".into()]);
        assert!(validate(&s, &both).is_ok());
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
        p["spec"]["containers"][1]["args"]
            .as_array_mut()
            .unwrap()
            .push(json!("--retire-file=/elsewhere"));
        let s = from_pod(&p, RETIRE, "t").unwrap();
        let args = container(&s, "proxy")["args"].to_string();
        assert!(!args.contains("/elsewhere"), "{args}");
        assert_eq!(args.matches("--retire-file").count(), 1, "{args}");
    }
}
