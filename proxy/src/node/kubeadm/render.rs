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
//!   [`crate::node::kubeadm::kubernetes_endpoints`]);
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

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodSecurityContext;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::node::apiserver_manifest::{
    image_version, kind_of, Flag, InvalidManifest, StaticPod, CONTAINER,
};
use crate::node::manifest::sha256_hex;
use crate::node::object::{
    self, Container, Deployment, EnvVar, PodDisruptionBudget, PodSpec, Probe, Volume, VolumeMount,
};

/// `manifests/base/deployment.yaml`, as built into this binary.
pub const BASE_DEPLOYMENT: &str = include_str!("../../../../manifests/base/deployment.yaml");
/// `manifests/base/pdb.yaml`, as built into this binary.
pub const BASE_PDB: &str = include_str!("../../../../manifests/base/pdb.yaml");
/// The kustomize component of `--client-address transparent`: `render --client-address
/// transparent` applies its patch, so the two cannot drift apart.
pub const TRANSPARENT_COMPONENT: &str =
    include_str!("../../../../manifests/client-address-transparent/kustomization.yaml");

/// Pod template annotation: the SHA-256 of kubeadm's manifest the Deployment was derived from.
pub const MANIFEST_DIGEST: &str = "kube-apiserver-proxy/kubeadm-manifest-sha256";
/// Pod template annotation: the SHA-256 of the files kubeadm's flags name.
pub const FILES_DIGEST: &str = "kube-apiserver-proxy/apiserver-files-sha256";
/// The label that stays with the node agent's pod (module documentation).
pub const COMPONENT_LABEL: &str = "component";

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

impl From<InvalidManifest> for RenderError {
    fn from(e: InvalidManifest) -> Self {
        RenderError::Manifest(e.0)
    }
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
pub fn base() -> Result<(Deployment, PodDisruptionBudget), RenderError> {
    Ok((base_object(BASE_DEPLOYMENT)?, base_object(BASE_PDB)?))
}

/// The document of kind `K` in `text`.
fn base_object<K>(text: &str) -> Result<K, RenderError>
where
    K: k8s_openapi::Resource + DeserializeOwned + Serialize,
{
    let docs =
        crate::base::yaml::parse_documents(text).map_err(|e| RenderError::Base(e.to_string()))?;
    let doc = docs
        .into_iter()
        .find(|d| kind_of(d) == K::KIND)
        .ok_or_else(|| RenderError::Base(format!("no {}", K::KIND)))?;
    object::from_value(doc).map_err(|e| RenderError::Base(e.to_string()))
}

fn base_err(what: &str) -> RenderError {
    RenderError::Base(what.to_owned())
}

/// The container named `name` in `containers`.
fn named<'a>(containers: &'a [Container], name: &str) -> Option<&'a Container> {
    containers.iter().find(|c| c.name == name)
}

/// The pod spec of a Deployment's template.
fn pod_spec(d: &Deployment) -> Option<&PodSpec> {
    d.spec.template.spec.as_ref()
}

fn pod_spec_mut(d: &mut Deployment) -> Result<&mut PodSpec, RenderError> {
    d.spec
        .template
        .spec
        .as_mut()
        .ok_or_else(|| base_err("no spec.template.spec"))
}

/// Every container of a pod: the init containers, then the others.
fn all_containers(spec: &mut PodSpec) -> impl Iterator<Item = &mut Container> {
    spec.init_containers
        .iter_mut()
        .flatten()
        .chain(spec.containers.iter_mut())
}

/// Replaces the value of every `--flag=...` word of a command.
fn set_word(words: &mut [String], flag: &str, value: &str) {
    for w in words.iter_mut() {
        if w.starts_with(&format!("{flag}=")) {
            *w = format!("{flag}={value}");
        }
    }
}

/// Replaces the value of every `--flag=...` word of an exec probe's command.
fn set_probe_word(probe: &mut Probe, flag: &str, value: &str) {
    if let Some(command) = probe.exec.as_mut().and_then(|e| e.command.as_mut()) {
        set_word(command, flag, value);
    }
}

/// The path of an httpGet probe.
fn http_path(probe: &Probe) -> Option<&str> {
    probe.http_get.as_ref()?.path.as_deref()
}

/// The Deployment for `pod`, from the base Deployment `base` (see the module documentation).
/// `files_digest` is the digest of the files the flags name, when they could be read.
pub fn deployment(
    base: &Deployment,
    pod: &StaticPod,
    files_digest: Option<&str>,
    options: &Options,
) -> Result<Deployment, RenderError> {
    let kubeadm = pod.container()?;
    let (binary, flags) = pod.command()?;
    let port = pod.secure_port()?;
    let current = pod.image();
    let image = options.image.clone().unwrap_or_else(|| current.clone());
    if !options.allow_downgrade {
        check_not_older(&image, &current)?;
    }

    let mut d = base.clone();
    d.metadata.namespace = Some(
        pod.pod
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "kube-system".to_owned()),
    );
    let spec = pod_spec_mut(&mut d)?;
    let base_container = named(&spec.containers, CONTAINER)
        .ok_or_else(|| base_err("no kube-apiserver container"))?
        .clone();

    let args = apiserver_args(&base_container, &flags)?;
    let mut c = apiserver_container(&base_container, kubeadm, &binary, port, args, &image);
    merge_env(&mut c, kubeadm);
    let kubeadm_volumes = pod.volumes();
    merge_mounts(&mut c, kubeadm, kubeadm_volumes);
    adopt_probes(&mut c, kubeadm);
    let readiness_path = kubeadm.readiness_probe.as_ref().and_then(http_path);

    adopt_pod_spec(spec, pod, kubeadm_volumes);
    place_containers(spec, c, port, readiness_path);
    if options.client_address_transparent {
        d = client_address_transparent(&d)?;
    }
    let spec = pod_spec_mut(&mut d)?;
    if let Some(img) = &options.proxy_image {
        for x in all_containers(spec).filter(|x| x.name != CONTAINER) {
            x.image = Some(img.clone());
        }
    }

    let ca = cluster_ca(pod);
    if ca != DEFAULT_CLUSTER_CA {
        with_cluster_ca(spec, &ca)?;
    }
    copy_metadata(&mut d, pod, files_digest);
    Ok(d)
}

/// The cluster CA the base's probes, health checks and `cluster-ca` volume name: kubeadm's
/// default `certificatesDir`'s.
pub const DEFAULT_CLUSTER_CA: &str = "/etc/kubernetes/pki/ca.crt";

/// The cluster CA of kubeadm's manifest, which signed the apiserver's serving certificate:
/// `ca.crt` in its `k8s-certs` volume (kubeadm's certificatesDir), else the default. Not its
/// `--client-ca-file`: that is the bundle client certificates are verified with, kubeadm's
/// `ca.crt` by default but the operator's to point at another bundle (an extraArg), which
/// would not verify the apiserver.
pub fn cluster_ca(pod: &StaticPod) -> String {
    pod.volumes()
        .iter()
        .find(|v| v.name == "k8s-certs")
        .and_then(|v| v.host_path.as_ref())
        .map(|h| format!("{}/ca.crt", h.path.trim_end_matches('/')))
        .unwrap_or_else(|| DEFAULT_CLUSTER_CA.to_owned())
}

/// Points the base's references to the default cluster CA at `ca` (a custom `certificatesDir`,
/// e.g. `/etc/kubernetes/ssl`): the proxy's `--health-ca-file`, the `cluster-ca` volume, the
/// probes' `--ca-file` in the apiserver container (whose own flags are kubeadm's, left alone).
fn with_cluster_ca(spec: &mut PodSpec, ca: &str) -> Result<(), RenderError> {
    for c in all_containers(spec) {
        if c.name == CONTAINER {
            for probe in [
                &mut c.startup_probe,
                &mut c.liveness_probe,
                &mut c.readiness_probe,
            ]
            .into_iter()
            .flatten()
            {
                replace_ca(probe, ca, "probe")?;
            }
        } else {
            replace_ca(c, ca, "container")?;
        }
    }
    if let Some(volumes) = spec.volumes.as_mut() {
        replace_ca(volumes, ca, "volumes")?;
    }
    Ok(())
}

/// [`DEFAULT_CLUSTER_CA`] replaced by `ca` in every string of `part` (a container, a probe,
/// the volumes), wherever the base names it: a substitution over the part's text, not over
/// chosen fields, so a reference the base adds is followed too.
fn replace_ca<T>(part: &mut T, ca: &str, what: &'static str) -> Result<(), RenderError>
where
    T: Serialize + DeserializeOwned,
{
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
    let mut v = object::to_value(part);
    replace(&mut v, ca);
    *part = object::typed(v, what).map_err(|e| RenderError::Base(e.to_string()))?;
    Ok(())
}

/// The kube-apiserver's flags: the Deployment's own, then kubeadm's in kubeadm's order (minus
/// those replaced), then the base's shutdown flags and the endpoint reconciler.
fn apiserver_args(base_container: &Container, flags: &[Flag]) -> Result<Vec<String>, RenderError> {
    // then the base's shutdown flags and the endpoint reconciler.
    let base_flags: Vec<Flag> = base_container
        .args
        .as_ref()
        .ok_or_else(|| base_err("the kube-apiserver container has no args"))?
        .iter()
        .map(|a| Flag::parse(a))
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
    base_container: &Container,
    kubeadm: &Container,
    binary: &str,
    port: u16,
    args: Vec<String>,
    image: &str,
) -> Container {
    let mut c = base_container.clone();
    if let Some(command) = c.command.as_mut() {
        set_word(command, "--port", &port.to_string());
        if let Some(last) = command.last_mut() {
            binary.clone_into(last);
        }
    }
    c.args = Some(args);
    c.image = Some(image.to_owned());
    if kubeadm.image_pull_policy.is_some() {
        c.image_pull_policy.clone_from(&kubeadm.image_pull_policy);
    }
    c.resources.clone_from(&kubeadm.resources);
    c.security_context.clone_from(&kubeadm.security_context);
    c.working_dir.clone_from(&kubeadm.working_dir);
    c.ports = None;
    c
}

/// Environment: the base's, then kubeadm's (kubeadm's wins on a name).
fn merge_env(c: &mut Container, kubeadm: &Container) {
    let kubeadm_env = kubeadm.env.as_deref().unwrap_or_default();
    c.env = Some(overlay(c.env.take(), kubeadm_env, |e: &EnvVar| {
        kubeadm_env.iter().any(|k| k.name == e.name)
    }));
    if kubeadm.env_from.is_some() {
        c.env_from.clone_from(&kubeadm.env_from);
    }
}

/// Volume mounts: kubeadm's, plus the base's that kubeadm's volumes and mounts do not shadow.
fn merge_mounts(c: &mut Container, kubeadm: &Container, kubeadm_volumes: &[Volume]) {
    let kubeadm_mounts = kubeadm.volume_mounts.as_deref().unwrap_or_default();
    let shadowed = |m: &VolumeMount| {
        kubeadm_volumes.iter().any(|v| v.name == m.name)
            || kubeadm_mounts.iter().any(|k| k.mount_path == m.mount_path)
    };
    c.volume_mounts = Some(overlay(c.volume_mounts.take(), kubeadm_mounts, shadowed));
}

/// The items of `base` that `shadowed` does not pick, then those of `kubeadm`.
fn overlay<T: Clone>(base: Option<Vec<T>>, kubeadm: &[T], shadowed: impl Fn(&T) -> bool) -> Vec<T> {
    let mut merged: Vec<T> = base
        .unwrap_or_default()
        .into_iter()
        .filter(|item| !shadowed(item))
        .collect();
    merged.extend(kubeadm.iter().cloned());
    merged
}

/// A probe's count (`failureThreshold`, `periodSeconds`), `default` when unset or negative.
fn count(v: Option<i32>, default: u64) -> u64 {
    v.and_then(|v| u64::try_from(v).ok()).unwrap_or(default)
}

/// Probes: the paths and budgets of kubeadm's.
fn adopt_probes(c: &mut Container, kubeadm: &Container) {
    if let Some(k) = &kubeadm.startup_probe {
        let p = c.startup_probe.get_or_insert_with(Probe::default);
        if let Some(path) = http_path(k) {
            set_probe_word(p, "--path", path);
        }
        let budget = count(k.failure_threshold, 3) * count(k.period_seconds, 10);
        let period = count(p.period_seconds, 2).max(1);
        p.failure_threshold =
            Some(i32::try_from(budget.div_ceil(period).max(1)).unwrap_or(i32::MAX));
        if k.timeout_seconds.is_some() {
            p.timeout_seconds = k.timeout_seconds;
        }
    }
    if let Some(k) = &kubeadm.liveness_probe {
        let p = c.liveness_probe.get_or_insert_with(Probe::default);
        if let Some(path) = http_path(k) {
            set_probe_word(p, "--path", path);
        }
        p.initial_delay_seconds = k.initial_delay_seconds.or(p.initial_delay_seconds);
        p.period_seconds = k.period_seconds.or(p.period_seconds);
        p.timeout_seconds = k.timeout_seconds.or(p.timeout_seconds);
        p.failure_threshold = k.failure_threshold.or(p.failure_threshold);
    }
}

/// The pod: the base's, with kubeadm's volumes, class and security context.
fn adopt_pod_spec(spec: &mut PodSpec, pod: &StaticPod, kubeadm_volumes: &[Volume]) {
    spec.volumes = Some(overlay(
        spec.volumes.take(),
        kubeadm_volumes,
        |v: &Volume| kubeadm_volumes.iter().any(|k| k.name == v.name),
    ));
    let Some(k) = &pod.pod.spec else { return };
    if k.priority_class_name.is_some() {
        spec.priority_class_name.clone_from(&k.priority_class_name);
    }
    if k.host_network.is_some() {
        spec.host_network = k.host_network;
    }
    if let Some(sc) = &k.security_context {
        spec.security_context = Some(match spec.security_context.take() {
            Some(base) => over(base, sc.clone()),
            None => sc.clone(),
        });
    }
}

/// kubeadm's pod security context `k` over the base's: each field kubeadm sets replaces the
/// base's whole (every field is named, so a field a newer k8s-openapi adds does not compile
/// until it is merged here too).
fn over(base: PodSecurityContext, k: PodSecurityContext) -> PodSecurityContext {
    let PodSecurityContext {
        app_armor_profile,
        fs_group,
        fs_group_change_policy,
        run_as_group,
        run_as_non_root,
        run_as_user,
        se_linux_change_policy,
        se_linux_options,
        seccomp_profile,
        supplemental_groups,
        supplemental_groups_policy,
        sysctls,
        windows_options,
    } = k;
    PodSecurityContext {
        app_armor_profile: app_armor_profile.or(base.app_armor_profile),
        fs_group: fs_group.or(base.fs_group),
        fs_group_change_policy: fs_group_change_policy.or(base.fs_group_change_policy),
        run_as_group: run_as_group.or(base.run_as_group),
        run_as_non_root: run_as_non_root.or(base.run_as_non_root),
        run_as_user: run_as_user.or(base.run_as_user),
        se_linux_change_policy: se_linux_change_policy.or(base.se_linux_change_policy),
        se_linux_options: se_linux_options.or(base.se_linux_options),
        seccomp_profile: seccomp_profile.or(base.seccomp_profile),
        supplemental_groups: supplemental_groups.or(base.supplemental_groups),
        supplemental_groups_policy: supplemental_groups_policy.or(base.supplemental_groups_policy),
        sysctls: sysctls.or(base.sysctls),
        windows_options: windows_options.or(base.windows_options),
    }
}

/// The kube-apiserver container `c` in its place; the sidecars serve kubeadm's port and check
/// the apiserver's readiness at kubeadm's path.
fn place_containers(spec: &mut PodSpec, c: Container, port: u16, readiness_path: Option<&str>) {
    for container in spec.containers.iter_mut() {
        if container.name == CONTAINER {
            *container = c.clone();
        } else if let Some(args) = container.args.as_mut() {
            for a in args.iter_mut() {
                if let Some(new) = sidecar_arg(a, port, readiness_path) {
                    *a = new;
                }
            }
        }
    }
}

/// A sidecar's argument on kubeadm's port and readiness path, when it names them.
fn sidecar_arg(a: &str, port: u16, readiness_path: Option<&str>) -> Option<String> {
    if let Some(addr) = a.strip_prefix("--listen=") {
        // The sidecar serves kubeadm's port.
        let (host, _) = addr.rsplit_once(':')?;
        Some(format!("--listen={host}:{port}"))
    } else if a.starts_with("--listen-port=") {
        // The node's addresses (--listen-host), on kubeadm's port.
        Some(format!("--listen-port={port}"))
    } else if a.starts_with("--health-path=") {
        // The sidecar checks the apiserver's readiness at kubeadm's path.
        readiness_path.map(|path| format!("--health-path={path}"))
    } else {
        None
    }
}

/// Labels and annotations: kubeadm's pod's, the digests of its manifest and files.
fn copy_metadata(d: &mut Deployment, pod: &StaticPod, files_digest: Option<&str>) {
    let meta = d
        .spec
        .template
        .metadata
        .get_or_insert_with(Default::default);
    let mut labels = meta.labels.take().unwrap_or_default();
    for (key, v) in pod.pod.metadata.labels.iter().flatten() {
        labels.entry(key.clone()).or_insert_with(|| v.clone());
    }
    labels.remove(COMPONENT_LABEL);
    meta.labels = Some(labels);
    let mut annotations = meta.annotations.take().unwrap_or_default();
    annotations.extend(kubeadm_annotations(pod));
    annotations.insert(MANIFEST_DIGEST.into(), pod.digest.clone());
    match files_digest {
        Some(f) => annotations.insert(FILES_DIGEST.into(), f.to_owned()),
        None => annotations.remove(FILES_DIGEST),
    };
    meta.annotations = Some(annotations);
}

/// The kustomize component: its first patch, a JSON patch as YAML text.
#[derive(Deserialize)]
struct Component {
    patches: Vec<ComponentPatch>,
}

#[derive(Deserialize)]
struct ComponentPatch {
    patch: String,
}

/// One JSON patch operation.
#[derive(Deserialize)]
struct PatchOp {
    op: String,
    path: String,
    #[serde(default)]
    value: Value,
}

/// The Deployment `d` with the patch of [`TRANSPARENT_COMPONENT`] applied: the JSON patch
/// operations it uses (`test`, `add`, `replace`; `-` appends to a list), on the Deployment's
/// JSON, read back as a Deployment. The component stays the one description of the mode.
fn client_address_transparent(d: &Deployment) -> Result<Deployment, RenderError> {
    let component =
        |what: &str| RenderError::Base(format!("manifests/client-address-transparent: {what}"));
    let docs = crate::base::yaml::parse_documents(TRANSPARENT_COMPONENT)
        .map_err(|e| component(&e.to_string()))?;
    let patch = docs
        .into_iter()
        .next()
        .and_then(|c| serde_json::from_value::<Component>(c).ok())
        .and_then(|c| c.patches.into_iter().next())
        .ok_or_else(|| component("no patch"))?
        .patch;
    let ops = crate::base::yaml::parse_documents(&patch).map_err(|e| component(&e.to_string()))?;
    let ops = match ops.into_iter().next() {
        Some(Value::Array(ops)) => ops,
        _ => return Err(component("the patch is not a list of operations")),
    };
    let mut d = object::to_value(d);
    for op in ops {
        let PatchOp {
            op: kind,
            path,
            value,
        } = serde_json::from_value(op.clone())
            .map_err(|_| component(&format!("operation without op or path: {op}")))?;
        let (parent, last) = path
            .rsplit_once('/')
            .ok_or_else(|| component(&format!("path {path}")))?;
        let target = d
            .pointer_mut(parent)
            .ok_or_else(|| component(&format!("{path}: not in the rendered Deployment")))?;
        match (kind.as_str(), target) {
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
                match kind.as_str() {
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
    object::from_value(d).map_err(|e| component(&e.to_string()))
}

/// The budget beside it, in the Deployment's namespace.
pub fn pdb(base_pdb: &PodDisruptionBudget, namespace: &str) -> PodDisruptionBudget {
    let mut p = base_pdb.clone();
    p.metadata.namespace = Some(namespace.to_owned());
    p
}

/// `s` as a JSON string, in quotes (as the names in [`lost`]'s list are written).
fn quoted(s: &str) -> String {
    Value::from(s).to_string()
}

/// Every flag and volume of kubeadm's pod that the Deployment does not carry as it was
/// (besides the documented replacements): empty when nothing is lost.
pub fn lost(pod: &StaticPod, deployment: &Deployment) -> Vec<String> {
    let mut lost = Vec::new();
    let Some((spec, c)) =
        pod_spec(deployment).and_then(|s| Some((s, named(&s.containers, CONTAINER)?)))
    else {
        return vec!["the kube-apiserver container".into()];
    };
    let args = c.args.as_deref().unwrap_or_default();
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
    let volumes = spec.volumes.as_deref().unwrap_or_default();
    for v in pod.volumes() {
        if !volumes.contains(v) {
            lost.push(format!("volume {}", quoted(&v.name)));
        }
    }
    let mounts = c.volume_mounts.as_deref().unwrap_or_default();
    if let Ok(k) = pod.container() {
        for m in k.volume_mounts.iter().flatten() {
            if !mounts.contains(m) {
                lost.push(format!("mount {}", quoted(&m.mount_path)));
            }
        }
        let env = c.env.as_deref().unwrap_or_default();
        for e in k.env.iter().flatten() {
            if !env.contains(e) {
                lost.push(format!("env {}", quoted(&e.name)));
            }
        }
        if k.resources != c.resources {
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
/// `static_pod` is kubeadm's manifest (`--static-pod`).
pub fn print(static_pod: &std::path::Path, options: &Options) -> Result<String, PrintError> {
    let path = static_pod.display().to_string();
    let text = std::fs::read_to_string(static_pod).map_err(|source| PrintError::Read {
        path: path.clone(),
        source,
    })?;
    let in_file = |source| PrintError::Render {
        path: path.clone(),
        source,
    };
    let pod = StaticPod::parse(&text).map_err(|e| in_file(e.into()))?;
    let address: std::net::IpAddr = pod
        .flag("advertise-address")
        .ok_or_else(|| in_file(RenderError::Manifest("no --advertise-address".into())))?
        .parse()
        .map_err(|e| in_file(RenderError::Manifest(format!("--advertise-address: {e}"))))?;
    crate::node::kubeadm::kubernetes_endpoints::check_address(address)
        .map_err(|e| in_file(RenderError::Manifest(format!("--advertise-address: {e}"))))?;
    let port = pod.secure_port().map_err(|e| in_file(e.into()))?;
    let (base_deployment, base_pdb) = base().map_err(PrintError::Other)?;
    let files = files_digest(&pod.files());
    let d = deployment(&base_deployment, &pod, files.as_deref(), options).map_err(|e| match e {
        e @ (RenderError::Downgrade { .. } | RenderError::Unversioned { .. }) => {
            PrintError::Other(e)
        }
        e => in_file(e),
    })?;
    let namespace = d
        .metadata
        .namespace
        .clone()
        .unwrap_or_else(|| "kube-system".to_owned());
    let mut out = String::new();
    out.push_str(&format!(
        "# kube-apiserver as a Deployment, derived from {path} by kube-apiserver-proxy render\n\
         # (docs/runbooks/migrate-from-kubeadm.md). kubeadm stays the source of truth:\n\
         # kubeadm-sync renders it again whenever kubeadm writes a new manifest.\n"
    ));
    out.push_str(&crate::node::kubeadm::kubernetes_endpoints::render(
        address, port,
    ));
    out.push_str("---\n");
    out.push_str(&crate::base::yaml::to_yaml(&object::to_value(&d)));
    out.push_str("---\n");
    out.push_str(&crate::base::yaml::to_yaml(&object::to_value(&pdb(
        &base_pdb, &namespace,
    ))));
    Ok(out)
}

/// Pod annotations of kubeadm's manifest, for the node agent's pod.
pub fn kubeadm_annotations(pod: &StaticPod) -> BTreeMap<String, String> {
    pod.pod.metadata.annotations.clone().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::object::{ObjectMeta, Pod};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::json;

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

    fn render(text: &str, options: &Options) -> Result<Deployment, RenderError> {
        let (base, _) = base().unwrap();
        deployment(&base, &StaticPod::parse(text).unwrap(), Some("f"), options)
    }

    fn spec(d: &Deployment) -> &PodSpec {
        pod_spec(d).unwrap()
    }

    fn apiserver(d: &Deployment) -> &Container {
        named(&spec(d).containers, CONTAINER).unwrap()
    }

    fn proxy(d: &Deployment) -> &Container {
        named(&spec(d).containers, "proxy").unwrap()
    }

    fn volume<'a>(d: &'a Deployment, name: &str) -> &'a Volume {
        let volumes = spec(d).volumes.as_ref().unwrap();
        volumes.iter().find(|v| v.name == name).unwrap()
    }

    fn words(list: &Option<Vec<String>>) -> Vec<&str> {
        list.iter().flatten().map(String::as_str).collect()
    }

    fn added_capabilities(c: &Container) -> Vec<&str> {
        let caps = c.security_context.as_ref().unwrap().capabilities.as_ref();
        words(&caps.unwrap().add)
    }

    #[test]
    fn every_flag_volume_mount_env_and_resource_is_carried_over() {
        let d = render(KUBEADM, &Options::default()).unwrap();
        let pod = StaticPod::parse(KUBEADM).unwrap();
        assert_eq!(lost(&pod, &d), Vec::<String>::new());
        let c = apiserver(&d);
        assert_eq!(
            c.image.as_deref(),
            Some("registry.k8s.io/kube-apiserver:v1.37.2")
        );
        let args = words(&c.args);
        assert_eq!(
            &args[..2],
            ["--bind-address={{address}}", "--secure-port={{port}}"]
        );
        assert!(args.contains(&"--service-cluster-ip-range=10.200.0.0/16"));
        assert!(args.contains(&"--endpoint-reconciler-type=none"));
        assert!(args.contains(&"--shutdown-delay-duration=15s"));
        assert!(!args.iter().any(|a| a.starts_with("--secure-port=6443")));
        let command = words(&c.command);
        assert_eq!(command.last(), Some(&"kube-apiserver"));
        assert!(command.contains(&"--port=6443"));
        let resources = c.resources.as_ref().unwrap();
        assert_eq!(
            resources.requests,
            Some([("cpu".to_owned(), Quantity("250m".into()))].into())
        );
        assert_eq!(
            (&resources.limits, &resources.claims),
            (&None, &None),
            "{resources:?}"
        );
        assert!(c.ports.is_none());
        // The base's own mounts stay (the launch binary, the address file).
        let mounts = c.volume_mounts.as_ref().unwrap();
        assert!(mounts.iter().any(|m| m.mount_path == "/proxy-bin"));
        assert!(mounts.iter().any(|m| m.mount_path == "/shared"));
        // Probes: kubeadm's paths and budgets (24 x 10 s start-up at the base's 2 s period).
        assert_eq!(
            c.startup_probe.as_ref().unwrap().failure_threshold,
            Some(120)
        );
        assert_eq!(
            c.liveness_probe.as_ref().unwrap().failure_threshold,
            Some(8)
        );
        let t = d.spec.template.metadata.as_ref().unwrap();
        let labels = t.labels.as_ref().unwrap();
        assert_eq!(labels["tier"], "control-plane");
        assert!(!labels.contains_key("component"));
        let annotations = t.annotations.as_ref().unwrap();
        assert_eq!(
            annotations["kubeadm.kubernetes.io/kube-apiserver.advertise-address.endpoint"],
            "192.0.2.10:6443"
        );
        assert_eq!(annotations[MANIFEST_DIGEST], pod.digest);
        assert!(spec(&d).priority.is_none());
        assert_eq!(d.metadata.namespace.as_deref(), Some("kube-system"));
        // The volumes of the same name are kubeadm's (DirectoryOrCreate), once each.
        let vols = spec(&d).volumes.as_ref().unwrap();
        assert_eq!(vols.iter().filter(|v| v.name == "k8s-certs").count(), 1);
        assert_eq!(
            volume(&d, "k8s-certs")
                .host_path
                .as_ref()
                .unwrap()
                .type_
                .as_deref(),
            Some("DirectoryOrCreate")
        );
    }

    #[test]
    fn a_custom_certificates_dir_is_followed() {
        // kubeadm's certificatesDir /etc/kubernetes/ssl: its flags, volume and mounts say so.
        let custom = KUBEADM.replace("/etc/kubernetes/pki", "/etc/kubernetes/ssl");
        let d = render(&custom, &Options::default()).unwrap();
        let text = object::to_value(spec(&d)).to_string();
        assert!(
            !text.contains("/etc/kubernetes/pki"),
            "the default certificates directory is still named: {text}"
        );
        assert_eq!(
            volume(&d, "cluster-ca").host_path.as_ref().unwrap().path,
            "/etc/kubernetes/ssl/ca.crt"
        );
        let proxy = spec(&d)
            .containers
            .iter()
            .find(|c| c.name != CONTAINER)
            .unwrap();
        assert!(words(&proxy.args).contains(&"--health-ca-file=/etc/kubernetes/ssl/ca.crt"));
        // A client CA bundle of the operator's (an extraArg) is not the CA of the apiserver's
        // serving certificate: the certificates directory's ca.crt stays the cluster CA.
        let bundle = custom.replace(
            "    - --secure-port=6443\n",
            "    - --client-ca-file=/etc/kubernetes/client-cas/bundle.crt\n    - --secure-port=6443\n",
        );
        assert_ne!(bundle, custom);
        let d = render(&bundle, &Options::default()).unwrap();
        assert_eq!(
            volume(&d, "cluster-ca").host_path.as_ref().unwrap().path,
            "/etc/kubernetes/ssl/ca.crt"
        );
        // The default directory: the base as it is.
        let d = render(KUBEADM, &Options::default()).unwrap();
        assert_eq!(
            volume(&d, "cluster-ca").host_path.as_ref().unwrap().path,
            DEFAULT_CLUSTER_CA
        );
    }

    /// The pod of `--client-address transparent` is a checkpoint only with the four
    /// capabilities it adds allowed (docs/runbooks/reboot-recovery.md): the init container's
    /// NET_ADMIN among them.
    #[test]
    fn a_transparent_pod_is_a_checkpoint_with_its_four_capabilities_allowed() {
        use crate::node::recovery::staticpod;
        let options = Options {
            proxy_image: Some("ghcr.io/example/kube-apiserver-proxy:v1".into()),
            client_address_transparent: true,
            ..Options::default()
        };
        let d = render(KUBEADM, &options).unwrap();
        let template = &d.spec.template;
        let mut spec = template.spec.clone().unwrap();
        spec.node_name = Some("node-1".into());
        let pod: Pod = object::from_value(json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "kube-apiserver-7d4f9c-abcde", "namespace": "kube-system",
                "uid": "u", "creationTimestamp": "2025-01-02T03:04:05Z",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                                     "name": "kube-apiserver-7d4f9c", "uid": "r"}]}}))
        .unwrap();
        let pod = Pod {
            metadata: ObjectMeta {
                labels: template.metadata.as_ref().unwrap().labels.clone(),
                ..pod.metadata
            },
            spec: Some(spec),
            status: None,
        };
        let checkpoint = staticpod::from_pod(&pod, "/run/retire", "2025-01-02T03:05:05Z").unwrap();
        let paths: Vec<String> = template
            .spec
            .iter()
            .flat_map(|s| s.volumes.iter().flatten())
            .filter_map(|v| Some(v.host_path.as_ref()?.path.clone()))
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
    fn kubeadms_pod_security_context_is_merged_over_the_bases() {
        let security = |text: &str| {
            let d = render(text, &Options::default()).unwrap();
            spec(&d).security_context.clone().unwrap()
        };
        let seccomp = |sc: &PodSecurityContext| {
            let p = sc.seccomp_profile.clone().unwrap();
            (p.type_, p.localhost_profile)
        };
        // A field of kubeadm's only is added, the base's others stay.
        let run_as = KUBEADM.replace(
            "  securityContext:\n    seccompProfile:\n      type: RuntimeDefault\n",
            "  securityContext:\n    runAsUser: 7\n",
        );
        let sc = security(&run_as);
        assert_eq!(sc.run_as_user, Some(7));
        assert_eq!(seccomp(&sc), ("RuntimeDefault".to_owned(), None));
        // A field both set is kubeadm's, whole.
        let localhost = KUBEADM.replace(
            "      type: RuntimeDefault\n",
            "      type: Localhost\n      localhostProfile: p.json\n",
        );
        let sc = security(&localhost);
        assert_eq!(
            seccomp(&sc),
            ("Localhost".to_owned(), Some("p.json".to_owned()))
        );
        assert_eq!(sc.run_as_user, None);
    }

    #[test]
    fn a_lost_flag_is_found() {
        let mut d = render(KUBEADM, &Options::default()).unwrap();
        let pod = StaticPod::parse(KUBEADM).unwrap();
        let c = pod_spec_mut(&mut d)
            .unwrap()
            .containers
            .iter_mut()
            .find(|c| c.name == CONTAINER)
            .unwrap();
        c.args
            .as_mut()
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
            apiserver(&render(KUBEADM, &allowed).unwrap())
                .image
                .as_deref(),
            Some("registry.k8s.io/kube-apiserver:v1.33.4")
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
        // A field this build does not know: the Deployment would go without it.
        let future = KUBEADM.replace(
            "    imagePullPolicy: IfNotPresent\n",
            "    futureField: 1\n",
        );
        let e = err(&future);
        assert!(e.contains("(spec.containers[0].futureField;"), "{e}");
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
        assert!(words(&apiserver(&d).command).contains(&"--port=8443"));
        assert_eq!(proxy(&d).image.as_deref(), Some("registry.local/kap:v9"));
        let init = &spec(&d).init_containers.as_ref().unwrap()[0];
        assert_eq!(init.image.as_deref(), Some("registry.local/kap:v9"));
        let proxy_args = words(&proxy(&d).args);
        assert!(proxy_args.contains(&"--listen=127.0.0.1:8443"));
        assert!(proxy_args.contains(&"--listen-port=8443"));
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
        let proxy = proxy(&d);
        let args = words(&proxy.args);
        assert!(args.contains(&"--client-address=transparent"));
        assert!(args.contains(&"--user=59443:59443"));
        assert_eq!(
            proxy.security_context.as_ref().unwrap().run_as_user,
            Some(0)
        );
        assert_eq!(added_capabilities(proxy), ["NET_RAW", "SETUID", "SETGID"]);
        let inits = spec(&d).init_containers.as_ref().unwrap();
        let init = inits
            .iter()
            .find(|c| c.name == "transparent-routes")
            .unwrap();
        assert_eq!(init.image.as_deref(), Some("registry.local/kap:v9"));
        assert_eq!(added_capabilities(init), ["NET_ADMIN"]);
        // The apiserver, the volumes and the rest are what the plain render gives.
        assert_eq!(apiserver(&d), apiserver(&plain));
        assert_eq!(spec(&d).volumes, spec(&plain).volumes);
        assert_eq!(
            inits.len(),
            spec(&plain).init_containers.as_ref().unwrap().len() + 1
        );
        assert!(crate::node::kubeadm::sync::transparent_client_address(&d));
        assert!(!crate::node::kubeadm::sync::transparent_client_address(
            &plain
        ));
    }
}
