//! The checkpoint of an apiserver pod as a static pod: the pure transformation applied to the pod
//! before it is written ([`crate::checkpoint`]), and the checks `recover` makes before it puts a
//! checkpoint into the kubelet's static pod directory.
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

/// Why a pod cannot become a checkpoint, or a file cannot be activated.
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

    // Set by the scheduler, admission plugins or controllers, or meaningless without an API.
    for field in [
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
    ] {
        spec.remove(field);
    }
    if spec.contains_key("runtimeClassName") {
        return Err(unusable(
            "spec.runtimeClassName needs the API (a RuntimeClass); a static pod cannot use it",
        ));
    }
    spec.insert("automountServiceAccountToken".into(), Value::Bool(false));

    // Volumes: keep what the kubelet can set up alone; drop service account tokens.
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

/// The host paths a checkpoint may mount when `recover` is given none: kubeadm's certificate
/// directories and the proxy's own node directories.
pub const DEFAULT_HOST_PATHS: &[&str] = &[
    "/etc/kubernetes/pki",
    "/etc/ssl/certs",
    "/etc/ca-certificates",
    "/etc/pki",
    "/usr/share/ca-certificates",
    "/usr/local/share/ca-certificates",
    "/run/kube-apiserver-proxy",
    "/var/lib/kube-apiserver-proxy",
];

/// Checks a checkpoint before it is given to the kubelet: a pod named [`NAME`] carrying its
/// origin, no privileged container, no host PID or IPC namespace, and host paths only under
/// `allowed`. The checkpoint is written by the `recover` node agent from a pod it read from
/// the API, whose spec anyone allowed to change the Deployment decides; the kubelet runs what
/// is activated as root, so the file is checked again here, whoever wrote it.
pub fn validate(checkpoint: &Value, allowed: &[String]) -> Result<Origin, Unusable> {
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
    for list in ["initContainers", "containers"] {
        for c in spec[list].as_array().into_iter().flatten() {
            if c["securityContext"]["privileged"] == true {
                return Err(unusable(format!(
                    "container {} is privileged",
                    c["name"].as_str().unwrap_or("?")
                )));
            }
        }
    }
    for v in spec["volumes"].as_array().into_iter().flatten() {
        if let Some(path) = v["hostPath"]["path"].as_str() {
            let inside = allowed.iter().any(|a| {
                let a = a.trim_end_matches('/');
                path == a || path.starts_with(&format!("{a}/"))
            });
            if !inside || path.split('/').any(|part| part == "..") {
                return Err(unusable(format!(
                    "volume {} mounts host path {path}, not under an allowed path ({})",
                    v["name"].as_str().unwrap_or("?"),
                    allowed.join(", ")
                )));
            }
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
        let allowed: Vec<String> = DEFAULT_HOST_PATHS.iter().map(|s| s.to_string()).collect();
        let origin = validate(&s, &allowed).unwrap();
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
        let allowed: Vec<String> = DEFAULT_HOST_PATHS.iter().map(|s| s.to_string()).collect();
        let good = from_pod(&pod(), RETIRE, "t").unwrap();
        type Break = fn(&mut Value);
        let cases: [(&str, Break); 5] = [
            ("host path /", |s| {
                s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/")
            }),
            ("host path /etc/kubernetes/pki/../..", |s| {
                s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/etc/kubernetes/pki/../..")
            }),
            ("privileged", |s| {
                s["spec"]["containers"][0]["securityContext"] = json!({"privileged": true})
            }),
            ("hostPID", |s| s["spec"]["hostPID"] = json!(true)),
            ("name", |s| s["metadata"]["name"] = json!("other")),
        ];
        for (what, break_it) in cases {
            let mut s = good.clone();
            break_it(&mut s);
            assert!(validate(&s, &allowed).is_err(), "{what} accepted");
        }
        // A sibling directory with a common prefix is not "under" an allowed path.
        let mut s = good.clone();
        s["spec"]["volumes"][2]["hostPath"]["path"] = json!("/etc/kubernetes/pki-other");
        assert!(validate(&s, &allowed).is_err());
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
