//! The Deployment derived from kubeadm's static apiserver pod (pure): `render` prints it, and
//! `kubeadm-sync` applies it whenever kubeadm writes a new manifest.
//!
//! The pod is the base Deployment of `manifests/base` (embedded at build time, so the sidecar,
//! the init container, the timings and the tolerations come from one place) with kubeadm's
//! apiserver merged into it. From kubeadm's pod, everything is carried over: the image and its
//! pull policy, every flag in kubeadm's order (duplicates too), the environment, the resources,
//! the security context, every volume and mount (extraVolumes, the CA directories kubeadm
//! mounts when they exist), the pod's annotations and labels, its priority class and security
//! context, and the probes' paths and budgets. The documented changes, and nothing else:
//!
//! - `--bind-address={{address}}`, `--secure-port={{port}}`: `launch` picks the random
//!   loopback address and the port (kubeadm's secure port) and the sidecar serves the node;
//! - `--endpoint-reconciler-type=none` (a single controller's endpoints are applied once;
//!   [`crate::node::kubernetes_endpoints`]);
//! - the shutdown flags of the base (`--shutdown-delay-duration`,
//!   `--shutdown-watch-termination-grace-period`, `--shutdown-send-retry-after`), which the
//!   proxy's drain timings are computed against;
//! - the sidecar serves kubeadm's secure port (`--listen=…:PORT`, `--listen-port=PORT`);
//! - the probes go through `kube-apiserver-proxy probe` to this pod's own address (an httpGet
//!   probe could only reach the shared node address), with kubeadm's paths and budgets;
//!   readiness is the sidecar's, which checks kubeadm's readiness path;
//! - no container ports (under hostNetwork a port is a host port, and the surge pod could
//!   never be scheduled beside the old one), no `priority` (admission sets it from the class);
//! - the label `component: kube-apiserver` stays with the node agent's pod
//!   (`kube-system/kube-apiserver-<node>`), which kubeadm and Cluster API look up: the
//!   Deployment's pods carry `tier: control-plane` and their own labels only.
//!
//! The pod template carries the digest of kubeadm's manifest and of the files its flags name
//! (certificates, keys, the audit policy, the encryption configuration): a change of any of
//! them is a new template, i.e. a surge rollout.

use std::path::Path;

use serde_json::{json, Map, Value};

/// `manifests/base/deployment.yaml`, as built into this binary.
pub const BASE_DEPLOYMENT: &str = include_str!("../../../manifests/base/deployment.yaml");
/// `manifests/base/pdb.yaml`, as built into this binary.
pub const BASE_PDB: &str = include_str!("../../../manifests/base/pdb.yaml");
/// The kustomize component of `--client-address transparent`: `render --client-address
/// transparent` applies its patch, so the two cannot drift apart.
pub const TRANSPARENT_COMPONENT: &str =
    include_str!("../../../manifests/client-address-transparent/kustomization.yaml");

/// Pod template annotation: the SHA-256 of kubeadm's manifest the Deployment was derived from.
pub const MANIFEST_DIGEST: &str = "kube-apiserver-proxy/kubeadm-manifest-sha256";
/// Pod template annotation: the SHA-256 of the files kubeadm's flags name.
pub const FILES_DIGEST: &str = "kube-apiserver-proxy/apiserver-files-sha256";
/// The label that stays with the node agent's pod (module documentation).
pub const COMPONENT_LABEL: &str = "component";
/// The apiserver container's name in kubeadm's pod and in the Deployment.
pub const CONTAINER: &str = "kube-apiserver";

/// Flags the Deployment sets itself; kubeadm's values of them are replaced.
const REPLACED: [&str; 6] = [
    "bind-address",
    "secure-port",
    "endpoint-reconciler-type",
    "shutdown-delay-duration",
    "shutdown-watch-termination-grace-period",
    "shutdown-send-retry-after",
];
/// Of [`REPLACED`], those whose value comes from the base Deployment.
const FROM_BASE: [&str; 3] = [
    "shutdown-delay-duration",
    "shutdown-watch-termination-grace-period",
    "shutdown-send-retry-after",
];

/// Why a manifest cannot be rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    #[error("{0}")]
    Manifest(String),
    #[error("the base Deployment: {0}")]
    Base(String),
    #[error(
        "--image {image} is older than {current}, which the static manifest runs; \
         pass --allow-downgrade to render it anyway"
    )]
    Downgrade { image: String, current: String },
    #[error(
        "cannot tell whether --image {image} is older than {current} (no vMAJOR.MINOR.PATCH tag); \
         pass --allow-downgrade to render it anyway"
    )]
    Unversioned { image: String, current: String },
}

/// What `render` is asked for besides the manifest.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The apiserver image (default: the manifest's).
    pub image: Option<String>,
    /// Render an image older than the manifest's.
    pub allow_downgrade: bool,
    /// The proxy image (default: the base's).
    pub proxy_image: Option<String>,
    /// `--client-address transparent` (the kustomize component
    /// `manifests/client-address-transparent`, applied to the rendered Deployment).
    pub client_address_transparent: bool,
}

/// kubeadm's static apiserver pod, parsed.
#[derive(Debug, Clone)]
pub struct StaticPod {
    /// The pod as read.
    pub pod: Value,
    /// SHA-256 of the file's bytes, hex.
    pub digest: String,
}

impl StaticPod {
    /// From the manifest's text.
    pub fn parse(text: &str) -> Result<Self, RenderError> {
        let docs = crate::base::yaml::parse_documents(text)
            .map_err(|e| RenderError::Manifest(format!("not YAML: {e}")))?;
        let [pod] = <[Value; 1]>::try_from(docs).map_err(|d| {
            RenderError::Manifest(format!("{} documents, one Pod expected", d.len()))
        })?;
        if pod["kind"] != "Pod" {
            return Err(RenderError::Manifest(format!(
                "kind {}, a Pod expected",
                pod["kind"]
            )));
        }
        let pod = StaticPod {
            pod,
            digest: sha256_hex(text.as_bytes()),
        };
        pod.container()?;
        Ok(pod)
    }

    /// The apiserver container: the one named `kube-apiserver`, else the only one.
    pub fn container(&self) -> Result<&Value, RenderError> {
        let containers = self.pod["spec"]["containers"]
            .as_array()
            .ok_or_else(|| RenderError::Manifest("no spec.containers".into()))?;
        let found = containers
            .iter()
            .find(|c| c["name"] == CONTAINER)
            .or(match containers.as_slice() {
                [only] => Some(only),
                _ => None,
            })
            .ok_or_else(|| RenderError::Manifest(format!("no container named {CONTAINER}")))?;
        if found["image"].as_str().is_none() {
            return Err(RenderError::Manifest(
                "the apiserver container has no image".into(),
            ));
        }
        Ok(found)
    }

    /// The binary (`command[0]`) and the flags (the rest of `command`, then `args`).
    pub fn command(&self) -> Result<(String, Vec<Flag>), RenderError> {
        let c = self.container()?;
        let strings = |v: &Value, what: &str| -> Result<Vec<String>, RenderError> {
            match v {
                Value::Null => Ok(Vec::new()),
                Value::Array(items) => items
                    .iter()
                    .map(|i| {
                        i.as_str().map(str::to_owned).ok_or_else(|| {
                            RenderError::Manifest(format!("{what}: {i} is not a string"))
                        })
                    })
                    .collect(),
                _ => Err(RenderError::Manifest(format!("{what} is not a list"))),
            }
        };
        let mut words = strings(&c["command"], "command")?;
        words.extend(strings(&c["args"], "args")?);
        if words.is_empty() {
            return Err(RenderError::Manifest(
                "the apiserver container has no command".into(),
            ));
        }
        let binary = words.remove(0);
        let flags = words
            .into_iter()
            .map(|w| Flag::parse(&w))
            .collect::<Result<_, _>>()?;
        Ok((binary, flags))
    }

    /// The value of the last `--name` flag.
    pub fn flag(&self, name: &str) -> Option<String> {
        let (_, flags) = self.command().ok()?;
        flags
            .into_iter()
            .rev()
            .find(|f| f.name == name)
            .and_then(|f| f.value)
    }

    /// The image it runs.
    pub fn image(&self) -> String {
        self.container()
            .ok()
            .and_then(|c| c["image"].as_str())
            .unwrap_or_default()
            .to_owned()
    }

    /// kubeadm's secure port (6443 when unset).
    pub fn secure_port(&self) -> Result<u16, RenderError> {
        match self.flag("secure-port") {
            None => Ok(6443),
            Some(p) => {
                p.parse().ok().filter(|p| *p != 0).ok_or_else(|| {
                    RenderError::Manifest(format!("--secure-port={p} is not a port"))
                })
            }
        }
    }

    /// Paths under `/etc/kubernetes/` that the flags name and that exist as regular files:
    /// what the apiserver reads from kubeadm's directory at start (certificates, keys, the
    /// audit policy, the encryption configuration). Only that directory: the node agent sees
    /// the node's `/etc/kubernetes` and nothing else of it. Not the files these name in turn
    /// (an admission plugin's configuration, a webhook's kubeconfig): a change to one of those
    /// alone rolls nothing (docs/runbooks/upgrade-kubernetes.md).
    pub fn files(&self) -> Vec<String> {
        let Ok((_, flags)) = self.command() else {
            return Vec::new();
        };
        let mut files: Vec<String> = flags
            .into_iter()
            .filter_map(|f| f.value)
            .filter(|v| v.starts_with("/etc/kubernetes/") && Path::new(v).is_file())
            .collect();
        files.sort();
        files.dedup();
        files
    }
}

/// One `--name[=value]` word of a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flag {
    pub name: String,
    pub value: Option<String>,
}

impl Flag {
    fn parse(word: &str) -> Result<Self, RenderError> {
        let rest = word.strip_prefix("--").ok_or_else(|| {
            RenderError::Manifest(format!(
                "argument {word:?} is not a --flag (kubeadm writes every flag as --name=value)"
            ))
        })?;
        Ok(match rest.split_once('=') {
            Some((n, v)) => Flag {
                name: n.to_owned(),
                value: Some(v.to_owned()),
            },
            None => Flag {
                name: rest.to_owned(),
                value: None,
            },
        })
    }

    fn word(&self) -> String {
        match &self.value {
            Some(v) => format!("--{}={v}", self.name),
            None => format!("--{}", self.name),
        }
    }
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SHA-256 over the files (each path and content); `None` when one cannot be read.
pub fn files_digest(files: &[String]) -> Option<String> {
    let mut all = Vec::new();
    for f in files {
        all.extend_from_slice(f.as_bytes());
        all.push(0);
        let content = std::fs::read(f).ok()?;
        all.extend_from_slice(sha256_hex(&content).as_bytes());
        all.push(b'\n');
    }
    Some(sha256_hex(&all))
}

/// `(major, minor, patch, pre-release)` of an image's `vX.Y.Z[-pre]` tag.
pub fn image_version(image: &str) -> Option<(u64, u64, u64, Option<String>)> {
    let name = image.split('@').next()?;
    let (_, tag) = name.rsplit_once(':').filter(|(n, _)| !n.ends_with('/'))?;
    if tag.contains('/') {
        return None;
    }
    let tag = tag.strip_prefix('v').unwrap_or(tag);
    let (core, pre) = match tag.split_once(['-', '+']) {
        Some((c, p)) => (c, Some(p.to_owned())),
        None => (tag, None),
    };
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    let v = (parts.next()??, parts.next()??, parts.next()??, pre);
    parts.next().is_none().then_some(v)
}

/// Refuses `image` when it is older than `current`: a release is newer than its pre-releases.
pub fn check_not_older(image: &str, current: &str) -> Result<(), RenderError> {
    let (Some(new), Some(cur)) = (image_version(image), image_version(current)) else {
        if image == current {
            return Ok(());
        }
        return Err(RenderError::Unversioned {
            image: image.into(),
            current: current.into(),
        });
    };
    let key = |v: &(u64, u64, u64, Option<String>)| (v.0, v.1, v.2, v.3.is_none());
    let older = key(&new) < key(&cur)
        || (key(&new) == key(&cur) && matches!((&new.3, &cur.3), (Some(a), Some(b)) if a < b));
    if older {
        return Err(RenderError::Downgrade {
            image: image.into(),
            current: current.into(),
        });
    }
    Ok(())
}

/// The base Deployment and PodDisruptionBudget.
pub fn base() -> Result<(Value, Value), RenderError> {
    let one = |text: &str, kind: &str| -> Result<Value, RenderError> {
        let docs = crate::base::yaml::parse_documents(text)
            .map_err(|e| RenderError::Base(e.to_string()))?;
        docs.into_iter()
            .find(|d| d["kind"] == kind)
            .ok_or_else(|| RenderError::Base(format!("no {kind}")))
    };
    Ok((
        one(BASE_DEPLOYMENT, "Deployment")?,
        one(BASE_PDB, "PodDisruptionBudget")?,
    ))
}

fn base_err(what: &str) -> RenderError {
    RenderError::Base(what.to_owned())
}

/// `items` (a list of objects) by their `name`.
fn by_name<'a>(items: &'a Value, name: &str) -> Option<&'a Value> {
    items.as_array()?.iter().find(|i| i["name"] == name)
}

/// Replaces the value of every `--flag=...` word of an exec probe's command.
fn set_word(command: &mut Value, flag: &str, value: &str) {
    if let Some(words) = command.as_array_mut() {
        for w in words.iter_mut() {
            if w.as_str()
                .is_some_and(|s| s.starts_with(&format!("{flag}=")))
            {
                *w = Value::String(format!("{flag}={value}"));
            }
        }
    }
}

/// The Deployment for `pod`, from the base Deployment `base` (see the module documentation).
/// `files_digest` is the digest of the files the flags name, when they could be read.
pub fn deployment(
    base: &Value,
    pod: &StaticPod,
    files_digest: Option<&str>,
    options: &Options,
) -> Result<Value, RenderError> {
    let kubeadm = pod.container()?;
    let (binary, flags) = pod.command()?;
    let port = pod.secure_port()?;
    let current = pod.image();
    let image = options.image.clone().unwrap_or_else(|| current.clone());
    if !options.allow_downgrade {
        check_not_older(&image, &current)?;
    }

    let mut d = base.clone();
    let namespace = pod.pod["metadata"]["namespace"]
        .as_str()
        .unwrap_or("kube-system")
        .to_owned();
    d["metadata"]["namespace"] = json!(namespace);
    let template = &mut d["spec"]["template"];
    let spec_base = template["spec"].clone();
    let base_container = by_name(&spec_base["containers"], CONTAINER)
        .ok_or_else(|| base_err("no kube-apiserver container"))?
        .clone();

    let args = apiserver_args(&base_container, &flags)?;
    let mut c = apiserver_container(&base_container, kubeadm, &binary, port, args, &image);
    merge_env(&mut c, kubeadm);
    let kubeadm_volumes = pod.pod["spec"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    merge_mounts(&mut c, kubeadm, &kubeadm_volumes);
    adopt_probes(&mut c, kubeadm);
    let readiness_path = kubeadm["readinessProbe"]["httpGet"]["path"]
        .as_str()
        .map(str::to_owned);

    let spec = &mut template["spec"];
    adopt_pod_spec(spec, pod, &kubeadm_volumes);
    place_containers(spec, c, port, readiness_path.as_deref())?;
    if options.client_address_transparent {
        client_address_transparent(&mut d)?;
    }
    let spec = &mut d["spec"]["template"]["spec"];
    if let Some(img) = &options.proxy_image {
        let with_proxy_image = |list: &mut Value| {
            for x in list.as_array_mut().into_iter().flatten() {
                if x["name"] != CONTAINER {
                    x["image"] = json!(img);
                }
            }
        };
        with_proxy_image(&mut spec["initContainers"]);
        with_proxy_image(&mut spec["containers"]);
    }

    let ca = cluster_ca(pod, &flags);
    if ca != DEFAULT_CLUSTER_CA {
        with_cluster_ca(&mut d["spec"]["template"]["spec"], &ca);
    }
    copy_metadata(&mut d, pod, files_digest);
    Ok(d)
}

/// The cluster CA the base's probes, health checks and `cluster-ca` volume name: kubeadm's
/// default `certificatesDir`'s.
pub const DEFAULT_CLUSTER_CA: &str = "/etc/kubernetes/pki/ca.crt";

/// The cluster CA of kubeadm's manifest: its `--client-ca-file` (kubeadm's
/// `<certificatesDir>/ca.crt`), else `ca.crt` in its `k8s-certs` volume (the certificatesDir),
/// else the default.
pub fn cluster_ca(pod: &StaticPod, flags: &[Flag]) -> String {
    if let Some(ca) = flags
        .iter()
        .find(|f| f.name == "--client-ca-file")
        .and_then(|f| f.value.clone())
    {
        return ca;
    }
    pod.pod["spec"]["volumes"]
        .as_array()
        .and_then(|v| by_name(&Value::Array(v.clone()), "k8s-certs").cloned())
        .and_then(|v| v["hostPath"]["path"].as_str().map(str::to_owned))
        .map(|dir| format!("{}/ca.crt", dir.trim_end_matches('/')))
        .unwrap_or_else(|| DEFAULT_CLUSTER_CA.to_owned())
}

/// Points the base's references to the default cluster CA at `ca` (a custom `certificatesDir`,
/// e.g. `/etc/kubernetes/ssl`): the proxy's `--health-ca-file`, the `cluster-ca` volume, the
/// probes' `--ca-file` in the apiserver container (whose own flags are kubeadm's, left alone).
fn with_cluster_ca(spec: &mut Value, ca: &str) {
    fn replace(v: &mut Value, ca: &str) {
        match v {
            Value::String(s) if s.contains(DEFAULT_CLUSTER_CA) => {
                *s = s.replace(DEFAULT_CLUSTER_CA, ca);
            }
            Value::Array(a) => a.iter_mut().for_each(|x| replace(x, ca)),
            Value::Object(o) => o.values_mut().for_each(|x| replace(x, ca)),
            _ => {}
        }
    }
    for list in ["initContainers", "containers"] {
        for c in spec[list].as_array_mut().into_iter().flatten() {
            if c["name"] == CONTAINER {
                for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
                    if let Some(p) = c.get_mut(probe) {
                        replace(p, ca);
                    }
                }
            } else {
                replace(c, ca);
            }
        }
    }
    replace(&mut spec["volumes"], ca);
}

/// The kube-apiserver's flags: the Deployment's own, then kubeadm's in kubeadm's order (minus
/// those replaced), then the base's shutdown flags and the endpoint reconciler.
fn apiserver_args(base_container: &Value, flags: &[Flag]) -> Result<Vec<String>, RenderError> {
    // then the base's shutdown flags and the endpoint reconciler.
    let base_flags: Vec<Flag> = base_container["args"]
        .as_array()
        .ok_or_else(|| base_err("the kube-apiserver container has no args"))?
        .iter()
        .filter_map(|a| a.as_str())
        .map(Flag::parse)
        .collect::<Result<_, _>>()
        .map_err(|e| base_err(&e.to_string()))?;
    let mut args = vec![
        "--bind-address={{address}}".to_owned(),
        "--secure-port={{port}}".to_owned(),
    ];
    args.extend(
        flags
            .iter()
            .filter(|f| !REPLACED.contains(&f.name.as_str()))
            .map(Flag::word),
    );
    for name in FROM_BASE {
        let f = base_flags
            .iter()
            .find(|f| f.name == name)
            .ok_or_else(|| base_err(&format!("no --{name}")))?;
        args.push(f.word());
    }
    args.push("--endpoint-reconciler-type=none".to_owned());

    Ok(args)
}

/// The kube-apiserver container: the base's launch wrapper and probes, kubeadm's everything
/// else.
fn apiserver_container(
    base_container: &Value,
    kubeadm: &Value,
    binary: &str,
    port: u16,
    args: Vec<String>,
    image: &str,
) -> Value {
    let mut c = base_container.clone();
    let mut command = c["command"].clone();
    set_word(&mut command, "--port", &port.to_string());
    if let Some(last) = command.as_array_mut().and_then(|w| w.last_mut()) {
        *last = json!(binary);
    }
    c["command"] = command;
    c["args"] = json!(args);
    c["image"] = json!(image);
    for key in [
        "imagePullPolicy",
        "resources",
        "securityContext",
        "workingDir",
    ] {
        match kubeadm.get(key) {
            Some(v) => c[key] = v.clone(),
            None => {
                if let Some(o) = c.as_object_mut() {
                    if key != "imagePullPolicy" {
                        o.remove(key);
                    }
                }
            }
        }
    }
    if let Some(o) = c.as_object_mut() {
        o.remove("ports");
    }
    c
}

/// Environment: the base's, then kubeadm's (kubeadm's wins on a name).
fn merge_env(c: &mut Value, kubeadm: &Value) {
    let kubeadm_env = kubeadm["env"].as_array().cloned().unwrap_or_default();
    let mut env: Vec<Value> = c["env"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| !kubeadm_env.iter().any(|k| k["name"] == e["name"]))
        .collect();
    env.extend(kubeadm_env);
    c["env"] = json!(env);
    if let Some(v) = kubeadm.get("envFrom") {
        c["envFrom"] = v.clone();
    }
}

/// Volume mounts: kubeadm's, plus the base's that kubeadm's volumes and mounts do not shadow.
fn merge_mounts(c: &mut Value, kubeadm: &Value, kubeadm_volumes: &[Value]) {
    let kubeadm_mounts = kubeadm["volumeMounts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let shadowed = |m: &Value| {
        kubeadm_volumes.iter().any(|v| v["name"] == m["name"])
            || kubeadm_mounts
                .iter()
                .any(|k| k["mountPath"] == m["mountPath"])
    };
    let mut mounts: Vec<Value> = c["volumeMounts"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| !shadowed(m))
        .collect();
    mounts.extend(kubeadm_mounts.iter().cloned());
    c["volumeMounts"] = json!(mounts);
}

/// Probes: the paths and budgets of kubeadm's.
fn adopt_probes(c: &mut Value, kubeadm: &Value) {
    if let Some(k) = kubeadm.get("startupProbe") {
        let p = &mut c["startupProbe"];
        if let Some(path) = k["httpGet"]["path"].as_str() {
            set_word(&mut p["exec"]["command"], "--path", path);
        }
        let budget =
            k["failureThreshold"].as_u64().unwrap_or(3) * k["periodSeconds"].as_u64().unwrap_or(10);
        let period = p["periodSeconds"].as_u64().unwrap_or(2).max(1);
        p["failureThreshold"] = json!(budget.div_ceil(period).max(1));
        if let Some(t) = k.get("timeoutSeconds") {
            p["timeoutSeconds"] = t.clone();
        }
    }
    if let Some(k) = kubeadm.get("livenessProbe") {
        let p = &mut c["livenessProbe"];
        if let Some(path) = k["httpGet"]["path"].as_str() {
            set_word(&mut p["exec"]["command"], "--path", path);
        }
        for key in [
            "initialDelaySeconds",
            "periodSeconds",
            "timeoutSeconds",
            "failureThreshold",
        ] {
            if let Some(v) = k.get(key) {
                p[key] = v.clone();
            }
        }
    }
}

/// The pod: the base's, with kubeadm's volumes, class and security context.
fn adopt_pod_spec(spec: &mut Value, pod: &StaticPod, kubeadm_volumes: &[Value]) {
    let mut volumes: Vec<Value> = spec["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|v| !kubeadm_volumes.iter().any(|k| k["name"] == v["name"]))
        .collect();
    volumes.extend(kubeadm_volumes.iter().cloned());
    spec["volumes"] = json!(volumes);
    for key in ["priorityClassName", "hostNetwork"] {
        if let Some(v) = pod.pod["spec"].get(key) {
            spec[key] = v.clone();
        }
    }
    if let Some(Value::Object(k)) = pod.pod["spec"].get("securityContext") {
        let merged = spec["securityContext"].as_object_mut();
        match merged {
            Some(m) => m.extend(k.clone()),
            None => spec["securityContext"] = Value::Object(k.clone()),
        }
    }
}

/// The kube-apiserver container `c` in its place; the sidecars serve kubeadm's port and check
/// the apiserver's readiness at kubeadm's path.
fn place_containers(
    spec: &mut Value,
    c: Value,
    port: u16,
    readiness_path: Option<&str>,
) -> Result<(), RenderError> {
    let containers = spec["containers"]
        .as_array_mut()
        .ok_or_else(|| base_err("no containers"))?;
    for container in containers.iter_mut() {
        if container["name"] == CONTAINER {
            *container = c.clone();
        } else if let Some(args) = container["args"].as_array_mut() {
            for a in args.iter_mut() {
                let Some(s) = a.as_str() else { continue };
                if let Some(addr) = s.strip_prefix("--listen=") {
                    // The sidecar serves kubeadm's port.
                    if let Some((host, _)) = addr.rsplit_once(':') {
                        *a = json!(format!("--listen={host}:{port}"));
                    }
                } else if s.starts_with("--listen-port=") {
                    // The node's addresses (--listen-host), on kubeadm's port.
                    *a = json!(format!("--listen-port={port}"));
                } else if let (Some(_), Some(path)) =
                    (s.strip_prefix("--health-path="), &readiness_path)
                {
                    // The sidecar checks the apiserver's readiness at kubeadm's path.
                    *a = json!(format!("--health-path={path}"));
                }
            }
        }
    }
    Ok(())
}

/// Labels and annotations: kubeadm's pod's, the digests of its manifest and files.
fn copy_metadata(d: &mut Value, pod: &StaticPod, files_digest: Option<&str>) {
    let meta = &mut d["spec"]["template"]["metadata"];
    let mut labels = meta["labels"].as_object().cloned().unwrap_or_default();
    if let Some(k) = pod.pod["metadata"]["labels"].as_object() {
        for (key, v) in k {
            labels.entry(key.clone()).or_insert_with(|| v.clone());
        }
    }
    labels.remove(COMPONENT_LABEL);
    meta["labels"] = Value::Object(labels);
    let mut annotations = meta["annotations"].as_object().cloned().unwrap_or_default();
    if let Some(k) = pod.pod["metadata"]["annotations"].as_object() {
        annotations.extend(k.clone());
    }
    annotations.insert(MANIFEST_DIGEST.into(), json!(pod.digest));
    match files_digest {
        Some(f) => annotations.insert(FILES_DIGEST.into(), json!(f)),
        None => annotations.remove(FILES_DIGEST),
    };
    meta["annotations"] = Value::Object(annotations);
}

/// Applies the patch of [`TRANSPARENT_COMPONENT`] to the Deployment `d`: the JSON patch
/// operations it uses (`test`, `add`, `replace`; `-` appends to a list).
fn client_address_transparent(d: &mut Value) -> Result<(), RenderError> {
    let component =
        |what: &str| RenderError::Base(format!("manifests/client-address-transparent: {what}"));
    let docs = crate::base::yaml::parse_documents(TRANSPARENT_COMPONENT)
        .map_err(|e| component(&e.to_string()))?;
    let patch = docs
        .first()
        .and_then(|c| c["patches"][0]["patch"].as_str())
        .ok_or_else(|| component("no patch"))?;
    let ops = crate::base::yaml::parse_documents(patch).map_err(|e| component(&e.to_string()))?;
    let ops = ops
        .first()
        .and_then(Value::as_array)
        .ok_or_else(|| component("the patch is not a list of operations"))?;
    for op in ops {
        let (Some(kind), Some(path)) = (op["op"].as_str(), op["path"].as_str()) else {
            return Err(component(&format!("operation without op or path: {op}")));
        };
        let value = op["value"].clone();
        let (parent, last) = path
            .rsplit_once('/')
            .ok_or_else(|| component(&format!("path {path}")))?;
        let target = d
            .pointer_mut(parent)
            .ok_or_else(|| component(&format!("{path}: not in the rendered Deployment")))?;
        match (kind, target) {
            ("test", t) => {
                if t.get(last) != Some(&value) && t.pointer(&format!("/{last}")) != Some(&value) {
                    return Err(component(&format!("{path} is not {value}")));
                }
            }
            ("add", Value::Array(list)) if last == "-" => list.push(value),
            ("add" | "replace", Value::Array(list)) => {
                let i: usize = last
                    .parse()
                    .map_err(|_| component(&format!("path {path}")))?;
                let len = list.len();
                match kind {
                    "replace" if i < len => list[i] = value,
                    "add" if i <= len => list.insert(i, value),
                    _ => return Err(component(&format!("{path}: no such element"))),
                }
            }
            ("add" | "replace", Value::Object(map)) => {
                map.insert(last.to_owned(), value);
            }
            _ => return Err(component(&format!("operation {kind} on {path}"))),
        }
    }
    Ok(())
}

/// The budget beside it, in the Deployment's namespace.
pub fn pdb(base_pdb: &Value, namespace: &str) -> Value {
    let mut p = base_pdb.clone();
    p["metadata"]["namespace"] = json!(namespace);
    p
}

/// Every flag and volume of kubeadm's pod that the Deployment does not carry as it was
/// (besides the documented replacements): empty when nothing is lost.
pub fn lost(pod: &StaticPod, deployment: &Value) -> Vec<String> {
    let mut lost = Vec::new();
    let spec = &deployment["spec"]["template"]["spec"];
    let Some(c) = by_name(&spec["containers"], CONTAINER) else {
        return vec!["the kube-apiserver container".into()];
    };
    let args: Vec<&str> = c["args"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if let Ok((_, flags)) = pod.command() {
        for f in flags
            .iter()
            .filter(|f| !REPLACED.contains(&f.name.as_str()))
        {
            let want = f.word();
            let have = args.iter().filter(|a| **a == want).count();
            let had = flags.iter().filter(|g| g.word() == want).count();
            if have != had {
                lost.push(format!("flag {want}"));
            }
        }
    }
    let empty = Vec::new();
    let volumes = spec["volumes"].as_array().unwrap_or(&empty);
    for v in pod.pod["spec"]["volumes"].as_array().unwrap_or(&empty) {
        if !volumes.contains(v) {
            lost.push(format!("volume {}", v["name"]));
        }
    }
    let mounts = c["volumeMounts"].as_array().unwrap_or(&empty);
    if let Ok(k) = pod.container() {
        for m in k["volumeMounts"].as_array().unwrap_or(&empty) {
            if !mounts.contains(m) {
                lost.push(format!("mount {}", m["mountPath"]));
            }
        }
        for e in k["env"].as_array().unwrap_or(&empty) {
            if !c["env"].as_array().unwrap_or(&empty).contains(e) {
                lost.push(format!("env {}", e["name"]));
            }
        }
        if k.get("resources") != c.get("resources") {
            lost.push("resources".into());
        }
    }
    lost
}

/// Why `render` could not print.
#[derive(Debug, thiserror::Error)]
pub enum PrintError {
    #[error("--static-pod {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("--static-pod {path}: {source}")]
    Render {
        path: String,
        #[source]
        source: RenderError,
    },
    #[error("{0}")]
    Other(RenderError),
}

impl crate::base::exit::CommandError for PrintError {
    /// A manifest `render` cannot read or use: bad input.
    fn is_bad_input(&self) -> bool {
        true
    }
}

/// `render`: the `default/kubernetes` endpoints, the Deployment and its budget, as one YAML
/// stream. The files the flags name are digested when they can be read (as root on the node);
/// otherwise the digest is left out and `kubeadm-sync` adds it (one extra rollout).
pub fn print(args: &crate::cli::RenderArgs) -> Result<String, PrintError> {
    let path = args.static_pod.display().to_string();
    let text = std::fs::read_to_string(&args.static_pod).map_err(|source| PrintError::Read {
        path: path.clone(),
        source,
    })?;
    let in_file = |source| PrintError::Render {
        path: path.clone(),
        source,
    };
    let pod = StaticPod::parse(&text).map_err(in_file)?;
    let address: std::net::IpAddr = pod
        .flag("advertise-address")
        .ok_or_else(|| in_file(RenderError::Manifest("no --advertise-address".into())))?
        .parse()
        .map_err(|e| in_file(RenderError::Manifest(format!("--advertise-address: {e}"))))?;
    crate::node::kubernetes_endpoints::check_address(address)
        .map_err(|e| in_file(RenderError::Manifest(format!("--advertise-address: {e}"))))?;
    let port = pod.secure_port().map_err(in_file)?;
    let options = Options {
        image: args.image.clone(),
        allow_downgrade: args.allow_downgrade,
        proxy_image: args.proxy_image.clone(),
        client_address_transparent: args.client_address == crate::cli::ClientAddress::Transparent,
    };
    let (base_deployment, base_pdb) = base().map_err(PrintError::Other)?;
    let files = files_digest(&pod.files());
    let d =
        deployment(&base_deployment, &pod, files.as_deref(), &options).map_err(|e| match e {
            e @ (RenderError::Downgrade { .. } | RenderError::Unversioned { .. }) => {
                PrintError::Other(e)
            }
            e => in_file(e),
        })?;
    let namespace = d["metadata"]["namespace"]
        .as_str()
        .unwrap_or("kube-system")
        .to_owned();
    let mut out = String::new();
    out.push_str(&format!(
        "# kube-apiserver as a Deployment, derived from {path} by kube-apiserver-proxy render\n\
         # (docs/runbooks/migrate-from-kubeadm.md). kubeadm stays the source of truth:\n\
         # kubeadm-sync renders it again whenever kubeadm writes a new manifest.\n"
    ));
    out.push_str(&crate::node::kubernetes_endpoints::render(address, port));
    out.push_str("---\n");
    out.push_str(&crate::base::yaml::to_yaml(&d));
    out.push_str("---\n");
    out.push_str(&crate::base::yaml::to_yaml(&pdb(&base_pdb, &namespace)));
    Ok(out)
}

/// Pod annotations of kubeadm's manifest, for the node agent's pod.
pub fn kubeadm_annotations(pod: &StaticPod) -> Map<String, Value> {
    pod.pod["metadata"]["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest as kubeadm v1.37 writes it (trimmed to what matters here), with extraArgs
    /// and extraVolumes for audit, encryption and OIDC.
    const KUBEADM: &str = r#"apiVersion: v1
kind: Pod
metadata:
  annotations:
    kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint: 192.0.2.10:6443
  labels:
    component: kube-apiserver
    tier: control-plane
  name: kube-apiserver
  namespace: kube-system
spec:
  containers:
  - command:
    - kube-apiserver
    - --advertise-address=192.0.2.10
    - --allow-privileged=true
    - --audit-log-path=/var/log/kubernetes/audit/audit.log
    - --audit-policy-file=/etc/kubernetes/audit/policy.yaml
    - --encryption-provider-config=/etc/kubernetes/encryption/config.yaml
    - --oidc-issuer-url=https://issuer.example
    - --secure-port=6443
    - --service-cluster-ip-range=10.200.0.0/16
    - --tls-cert-file=/etc/kubernetes/pki/apiserver.crt
    image: registry.k8s.io/kube-apiserver:v1.37.2
    imagePullPolicy: IfNotPresent
    env:
    - name: GOMAXPROCS
      value: "2"
    livenessProbe:
      failureThreshold: 8
      httpGet:
        host: 192.0.2.10
        path: /livez
        port: probe-port
        scheme: HTTPS
      initialDelaySeconds: 10
      periodSeconds: 10
      timeoutSeconds: 15
    name: kube-apiserver
    ports:
    - containerPort: 6443
      name: probe-port
      protocol: TCP
    readinessProbe:
      failureThreshold: 3
      httpGet:
        host: 192.0.2.10
        path: /readyz
        port: probe-port
        scheme: HTTPS
      periodSeconds: 1
      timeoutSeconds: 15
    resources:
      requests:
        cpu: 250m
    startupProbe:
      failureThreshold: 24
      httpGet:
        host: 192.0.2.10
        path: /livez
        port: probe-port
        scheme: HTTPS
      initialDelaySeconds: 10
      periodSeconds: 10
      timeoutSeconds: 15
    volumeMounts:
    - mountPath: /etc/ssl/certs
      name: ca-certs
      readOnly: true
    - mountPath: /etc/kubernetes/pki
      name: k8s-certs
      readOnly: true
    - mountPath: /etc/kubernetes/audit
      name: audit
      readOnly: true
    - mountPath: /var/log/kubernetes/audit
      name: audit-log
  hostNetwork: true
  priority: 2000001000
  priorityClassName: system-node-critical
  securityContext:
    seccompProfile:
      type: RuntimeDefault
  volumes:
  - hostPath:
      path: /etc/ssl/certs
      type: DirectoryOrCreate
    name: ca-certs
  - hostPath:
      path: /etc/kubernetes/pki
      type: DirectoryOrCreate
    name: k8s-certs
  - hostPath:
      path: /etc/kubernetes/audit
      type: DirectoryOrCreate
    name: audit
  - hostPath:
      path: /var/log/kubernetes/audit
      type: DirectoryOrCreate
    name: audit-log
status: {}
"#;

    fn render(text: &str, options: &Options) -> Result<Value, RenderError> {
        let (base, _) = base().unwrap();
        deployment(&base, &StaticPod::parse(text).unwrap(), Some("f"), options)
    }

    fn apiserver(d: &Value) -> &Value {
        by_name(&d["spec"]["template"]["spec"]["containers"], CONTAINER).unwrap()
    }

    #[test]
    fn every_flag_volume_mount_env_and_resource_is_carried_over() {
        let d = render(KUBEADM, &Options::default()).unwrap();
        let pod = StaticPod::parse(KUBEADM).unwrap();
        assert_eq!(lost(&pod, &d), Vec::<String>::new());
        let c = apiserver(&d);
        assert_eq!(c["image"], "registry.k8s.io/kube-apiserver:v1.37.2");
        let args: Vec<&str> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap())
            .collect();
        assert_eq!(
            &args[..2],
            ["--bind-address={{address}}", "--secure-port={{port}}"]
        );
        assert!(args.contains(&"--service-cluster-ip-range=10.200.0.0/16"));
        assert!(args.contains(&"--endpoint-reconciler-type=none"));
        assert!(args.contains(&"--shutdown-delay-duration=15s"));
        assert!(!args.iter().any(|a| a.starts_with("--secure-port=6443")));
        assert_eq!(
            c["command"].as_array().unwrap().last().unwrap(),
            "kube-apiserver"
        );
        assert!(c["command"]
            .as_array()
            .unwrap()
            .contains(&json!("--port=6443")));
        assert_eq!(c["resources"], json!({"requests": {"cpu": "250m"}}));
        assert!(c.get("ports").is_none());
        // The base's own mounts stay (the launch binary, the address file).
        let mounts = c["volumeMounts"].as_array().unwrap();
        assert!(mounts.iter().any(|m| m["mountPath"] == "/proxy-bin"));
        assert!(mounts.iter().any(|m| m["mountPath"] == "/shared"));
        // Probes: kubeadm's paths and budgets (24 x 10 s start-up at the base's 2 s period).
        assert_eq!(c["startupProbe"]["failureThreshold"], 120);
        assert_eq!(c["livenessProbe"]["failureThreshold"], 8);
        let t = &d["spec"]["template"];
        assert_eq!(t["metadata"]["labels"]["tier"], "control-plane");
        assert!(t["metadata"]["labels"].get("component").is_none());
        assert_eq!(
            t["metadata"]["annotations"]
                ["kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint"],
            "192.0.2.10:6443"
        );
        assert_eq!(t["metadata"]["annotations"][MANIFEST_DIGEST], pod.digest);
        assert!(t["spec"].get("priority").is_none());
        assert_eq!(d["metadata"]["namespace"], "kube-system");
        // The volumes of the same name are kubeadm's (DirectoryOrCreate), once each.
        let vols = t["spec"]["volumes"].as_array().unwrap();
        assert_eq!(vols.iter().filter(|v| v["name"] == "k8s-certs").count(), 1);
        assert_eq!(
            by_name(&t["spec"]["volumes"], "k8s-certs").unwrap()["hostPath"]["type"],
            "DirectoryOrCreate"
        );
    }

    #[test]
    fn a_custom_certificates_dir_is_followed() {
        // kubeadm's certificatesDir /etc/kubernetes/ssl: its flags, volume and mounts say so.
        let custom = KUBEADM.replace("/etc/kubernetes/pki", "/etc/kubernetes/ssl");
        let d = render(&custom, &Options::default()).unwrap();
        let spec = &d["spec"]["template"]["spec"];
        let text = spec.to_string();
        assert!(
            !text.contains("/etc/kubernetes/pki"),
            "the default certificates directory is still named: {text}"
        );
        assert_eq!(
            by_name(&spec["volumes"], "cluster-ca").unwrap()["hostPath"]["path"],
            "/etc/kubernetes/ssl/ca.crt"
        );
        let proxy = spec["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] != CONTAINER)
            .unwrap();
        assert!(proxy["args"]
            .as_array()
            .unwrap()
            .contains(&json!("--health-ca-file=/etc/kubernetes/ssl/ca.crt")));
        // The default directory: the base as it is.
        let d = render(KUBEADM, &Options::default()).unwrap();
        assert_eq!(
            by_name(&d["spec"]["template"]["spec"]["volumes"], "cluster-ca").unwrap()["hostPath"]
                ["path"],
            DEFAULT_CLUSTER_CA
        );
    }

    /// The pod of `--client-address transparent` is a checkpoint only with the four
    /// capabilities it adds allowed (docs/runbooks/reboot-recovery.md): the init container's
    /// NET_ADMIN among them.
    #[test]
    fn a_transparent_pod_is_a_checkpoint_with_its_four_capabilities_allowed() {
        use crate::node::staticpod;
        let options = Options {
            proxy_image: Some("ghcr.io/example/kube-apiserver-proxy:v1".into()),
            client_address_transparent: true,
            ..Options::default()
        };
        let d = render(KUBEADM, &options).unwrap();
        let template = &d["spec"]["template"];
        let mut spec = template["spec"].clone();
        spec["nodeName"] = json!("node-1");
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "kube-apiserver-7d4f9c-abcde", "namespace": "kube-system",
                "uid": "u", "creationTimestamp": "2025-01-02T03:04:05Z",
                "labels": template["metadata"]["labels"],
                "ownerReferences": [{"kind": "ReplicaSet", "name": "kube-apiserver-7d4f9c"}]},
            "spec": spec});
        let checkpoint = staticpod::from_pod(&pod, "/run/retire", "2025-01-02T03:05:05Z").unwrap();
        let paths: Vec<String> = template["spec"]["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|v| v["hostPath"]["path"].as_str().map(str::to_owned))
            .collect();
        let policy = |caps: &[&str]| {
            staticpod::Policy::new(
                &paths,
                &["ghcr.io/example/kube-apiserver-proxy".to_owned()],
                &[],
            )
            .allow_capabilities(&caps.iter().map(|c| c.to_string()).collect::<Vec<_>>())
        };
        staticpod::validate(
            &checkpoint,
            &policy(&["NET_ADMIN", "NET_RAW", "SETUID", "SETGID"]),
        )
        .unwrap();
        let refused = staticpod::validate(&checkpoint, &policy(&["NET_RAW", "SETUID", "SETGID"]))
            .unwrap_err();
        assert!(refused.to_string().contains("NET_ADMIN"), "{refused}");
    }

    #[test]
    fn a_lost_flag_is_found() {
        let mut d = render(KUBEADM, &Options::default()).unwrap();
        let pod = StaticPod::parse(KUBEADM).unwrap();
        let c = d["spec"]["template"]["spec"]["containers"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|c| c["name"] == CONTAINER)
            .unwrap();
        c["args"]
            .as_array_mut()
            .unwrap()
            .retain(|a| a != "--oidc-issuer-url=https://issuer.example");
        assert_eq!(
            lost(&pod, &d),
            vec!["flag --oidc-issuer-url=https://issuer.example"]
        );
    }

    #[test]
    fn older_images_are_refused_unless_allowed() {
        let older = Options {
            image: Some("registry.k8s.io/kube-apiserver:v1.33.4".into()),
            ..Options::default()
        };
        assert!(matches!(
            render(KUBEADM, &older),
            Err(RenderError::Downgrade { .. })
        ));
        let allowed = Options {
            allow_downgrade: true,
            ..older
        };
        assert_eq!(
            apiserver(&render(KUBEADM, &allowed).unwrap())["image"],
            "registry.k8s.io/kube-apiserver:v1.33.4"
        );
        let newer = Options {
            image: Some("registry.local:5000/kube-apiserver:v1.38.0".into()),
            ..Options::default()
        };
        assert!(render(KUBEADM, &newer).is_ok());
        assert!(check_not_older("r/k:v1.37.2-rc.1", "r/k:v1.37.2").is_err());
        assert!(check_not_older("r/k:v1.37.2", "r/k:v1.37.2-rc.1").is_ok());
        assert!(check_not_older("r/k:v1.37.10", "r/k:v1.37.9").is_ok());
        assert!(matches!(
            check_not_older("r/k:latest", "r/k:v1.37.2"),
            Err(RenderError::Unversioned { .. })
        ));
        assert!(check_not_older("r/k@sha256:ab", "r/k@sha256:ab").is_ok());
    }

    #[test]
    fn bad_manifests_say_what_is_wrong() {
        let err = |text: &str| StaticPod::parse(text).unwrap_err().to_string();
        assert!(err("a: [").starts_with("not YAML"));
        assert!(err("kind: Deployment\n").contains("a Pod expected"));
        assert!(err("kind: Pod\nspec: {}\n").contains("spec.containers"));
        let positional = KUBEADM.replace("- --allow-privileged=true", "- allow");
        let pod = StaticPod::parse(&positional).unwrap();
        assert!(pod.command().unwrap_err().to_string().contains("\"allow\""));
    }

    #[test]
    fn a_non_default_port_reaches_launch_and_the_proxy_image_every_proxy_container() {
        let text = KUBEADM.replace("--secure-port=6443", "--secure-port=8443");
        let d = render(
            &text,
            &Options {
                proxy_image: Some("registry.local/kap:v9".into()),
                ..Options::default()
            },
        )
        .unwrap();
        let spec = &d["spec"]["template"]["spec"];
        assert!(apiserver(&d)["command"]
            .as_array()
            .unwrap()
            .contains(&json!("--port=8443")));
        assert_eq!(
            by_name(&spec["containers"], "proxy").unwrap()["image"],
            "registry.local/kap:v9"
        );
        assert_eq!(spec["initContainers"][0]["image"], "registry.local/kap:v9");
        let proxy_args = &by_name(&spec["containers"], "proxy").unwrap()["args"];
        assert!(proxy_args
            .as_array()
            .unwrap()
            .contains(&json!("--listen=127.0.0.1:8443")));
        assert!(proxy_args
            .as_array()
            .unwrap()
            .contains(&json!("--listen-port=8443")));
    }

    #[test]
    fn transparent_mode_is_the_components_pod_and_nothing_else_changes() {
        let options = Options {
            proxy_image: Some("registry.local/kap:v9".into()),
            ..Options::default()
        };
        let plain = render(KUBEADM, &options).unwrap();
        let d = render(
            KUBEADM,
            &Options {
                client_address_transparent: true,
                ..options
            },
        )
        .unwrap();
        let spec = &d["spec"]["template"]["spec"];
        let proxy = by_name(&spec["containers"], "proxy").unwrap();
        let args = proxy["args"].as_array().unwrap();
        assert!(args.contains(&json!("--client-address=transparent")));
        assert!(args.contains(&json!("--user=59443:59443")));
        assert_eq!(proxy["securityContext"]["runAsUser"], 0);
        assert_eq!(
            proxy["securityContext"]["capabilities"]["add"],
            json!(["NET_RAW", "SETUID", "SETGID"])
        );
        let init = by_name(&spec["initContainers"], "transparent-routes").unwrap();
        assert_eq!(init["image"], "registry.local/kap:v9");
        assert_eq!(
            init["securityContext"]["capabilities"]["add"],
            json!(["NET_ADMIN"])
        );
        // The apiserver, the volumes and the rest are what the plain render gives.
        assert_eq!(apiserver(&d), apiserver(&plain));
        assert_eq!(
            spec["volumes"],
            plain["spec"]["template"]["spec"]["volumes"]
        );
        assert_eq!(
            spec["initContainers"].as_array().unwrap().len(),
            plain["spec"]["template"]["spec"]["initContainers"]
                .as_array()
                .unwrap()
                .len()
                + 1
        );
        assert!(crate::node::kubeadm_sync::client_address_transparent(&d));
        assert!(!crate::node::kubeadm_sync::client_address_transparent(
            &plain
        ));
    }
}
