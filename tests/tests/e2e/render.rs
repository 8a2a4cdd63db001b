//! `render` on manifests written by the real kubeadm (v1.37.2, built from the Go module proxy by
//! `tests/cluster/build/components`, cached; `KAP_KUBEADM` names another binary): kubeadm's
//! own `init phase control-plane apiserver --dry-run` writes the static pod for a plain
//! configuration, one with extraArgs, extraEnvs and extraVolumes for audit, encryption at rest,
//! OIDC and a service CIDR of its own, and one on port 8443. The stream `render` prints is read
//! back with PyYAML (another YAML implementation than the one that wrote it), checked against
//! the manifest flag by flag and volume by volume (nothing lost, only the documented changes),
//! and validated with `kubernetes-validate --strict`. An older `--image` is refused with exit 2
//! and one line, unless `--allow-downgrade`.
//!
//! Needs Go >= 1.26 (to build kubeadm once), python3 with PyYAML and kubernetes-validate; without
//! them the test says it is skipped, except in CI, where it fails.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, ensure, Context, Result};
use kube_apiserver_proxy_tests::process::{
    bad_input_line, output_text, output_with_input, pyyaml_docs,
};
use kube_apiserver_proxy_tests::proxy::proxy_bin;
use kube_apiserver_proxy_tests::util::{skip, TempDir};
use serde_json::Value;

const KUBEADM_VERSION: &str = "v1.37.2";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_owned()
}

/// The real kubeadm: `$KAP_KUBEADM`, or built (once, cached) by tests/cluster/build/components.
/// `None` (skipped) when it cannot be had outside CI.
fn kubeadm() -> Result<Option<PathBuf>> {
    if let Some(k) = std::env::var_os("KAP_KUBEADM") {
        return Ok(Some(PathBuf::from(k)));
    }
    if Command::new("go").arg("version").output().is_err() {
        skip(
            "render_real_kubeadm",
            "go not found: kubeadm is built from the Go module proxy",
        )?;
        return Ok(None);
    }
    let out = Command::new(repo_root().join("tests/cluster/build/components"))
        .arg(format!("kubeadm@{KUBEADM_VERSION}"))
        .stderr(Stdio::inherit())
        .output()
        .context("run tests/cluster/build/components")?;
    ensure!(
        out.status.success(),
        "building kubeadm {KUBEADM_VERSION} failed"
    );
    let line = String::from_utf8(out.stdout)?;
    let path = line
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow!("components printed {line:?}"))?;
    Ok(Some(PathBuf::from(path)))
}

fn tools() -> Result<bool> {
    let works = |cmd: &str, args: &[&str]| {
        Command::new(cmd)
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if works("python3", &["-c", "import yaml"]) && works("kubernetes-validate", &["--version"]) {
        return Ok(true);
    }
    skip(
        "render_real_kubeadm",
        "python3 with PyYAML and kubernetes-validate needed (pip install kubernetes-validate)",
    )?;
    Ok(false)
}

/// A YAML stream read by PyYAML.
fn yaml_docs(yaml: &str) -> Result<Vec<Value>> {
    pyyaml_docs(yaml)
}

/// kubeadm's static apiserver pod for `cluster` (a ClusterConfiguration's fields).
fn kubeadm_manifest(kubeadm: &Path, dir: &Path, port: u16, cluster: &str) -> Result<String> {
    let config = dir.join("kubeadm.yaml");
    std::fs::write(
        &config,
        format!(
            "apiVersion: kubeadm.k8s.io/v1beta4\nkind: InitConfiguration\n\
             localAPIEndpoint:\n  advertiseAddress: 192.0.2.10\n  bindPort: {port}\n\
             nodeRegistration:\n  name: node-1\n---\n\
             apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\n\
             kubernetesVersion: {KUBEADM_VERSION}\n{cluster}"
        ),
    )?;
    let out_dir = dir.join("out");
    let out = Command::new(kubeadm)
        .args([
            "init",
            "phase",
            "control-plane",
            "apiserver",
            "--dry-run",
            "--config",
        ])
        .arg(&config)
        .env("KUBEADM_INIT_DRYRUN_DIR", &out_dir)
        .output()
        .context("run kubeadm")?;
    ensure!(
        out.status.success(),
        "kubeadm init phase control-plane apiserver: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(std::fs::read_to_string(
        out_dir.join("kube-apiserver.yaml"),
    )?)
}

const EXTRA: &str = "networking:
  serviceSubnet: 10.200.0.0/16
apiServer:
  extraArgs:
  - name: audit-policy-file
    value: /etc/kubernetes/audit/policy.yaml
  - name: audit-log-path
    value: /var/log/kubernetes/audit/audit.log
  - name: audit-log-maxage
    value: \"30\"
  - name: encryption-provider-config
    value: /etc/kubernetes/encryption/config.yaml
  - name: oidc-issuer-url
    value: https://issuer.example
  - name: oidc-client-id
    value: kubernetes
  - name: feature-gates
    value: AllAlpha=false
  extraEnvs:
  - name: GOMAXPROCS
    value: \"2\"
  extraVolumes:
  - name: audit
    hostPath: /etc/kubernetes/audit
    mountPath: /etc/kubernetes/audit
    readOnly: true
    pathType: DirectoryOrCreate
  - name: audit-log
    hostPath: /var/log/kubernetes/audit
    mountPath: /var/log/kubernetes/audit
    pathType: DirectoryOrCreate
  - name: encryption
    hostPath: /etc/kubernetes/encryption
    mountPath: /etc/kubernetes/encryption
    readOnly: true
    pathType: DirectoryOrCreate
";

/// Flags the Deployment sets itself (docs/runbooks/migrate-from-kubeadm.md, step 1): kubeadm's
/// values of them go.
const REPLACED: [&str; 6] = [
    "--bind-address",
    "--secure-port",
    "--endpoint-reconciler-type",
    "--shutdown-delay-duration",
    "--shutdown-watch-termination-grace-period",
    "--shutdown-send-retry-after",
];

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

fn by_name<'a>(list: &'a Value, name: &str) -> Option<&'a Value> {
    list.as_array()?.iter().find(|i| i["name"] == name)
}

/// Renders `manifest` and checks the stream against it.
fn check(name: &str, manifest: &str, dir: &Path, port: u16) -> Result<()> {
    let file = dir.join(format!("{name}.yaml"));
    std::fs::write(&file, manifest)?;
    let out = Command::new(proxy_bin()?)
        .args(["render", "--static-pod"])
        .arg(&file)
        .output()?;
    ensure!(
        out.status.success(),
        "{name}: render failed ({:?}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let stream = String::from_utf8(out.stdout)?;
    let docs = yaml_docs(&stream).with_context(|| format!("{name}: the stream"))?;
    let kinds: Vec<&str> = docs.iter().filter_map(|d| d["kind"].as_str()).collect();
    for kind in [
        "Endpoints",
        "EndpointSlice",
        "Deployment",
        "PodDisruptionBudget",
    ] {
        ensure!(kinds.contains(&kind), "{name}: no {kind} in {kinds:?}");
    }
    let pod = &yaml_docs(manifest)?[0];
    let kc = &pod["spec"]["containers"][0];
    let d = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("checked");
    let spec = &d["spec"]["template"]["spec"];
    let c =
        by_name(&spec["containers"], "kube-apiserver").context("no kube-apiserver container")?;

    // Every flag of kubeadm's, as often as kubeadm gives it, besides the replaced ones.
    let args = strings(&c["args"]);
    let kubeadm_flags: Vec<String> = strings(&kc["command"]).into_iter().skip(1).collect();
    let mut want: BTreeMap<&str, usize> = BTreeMap::new();
    for f in &kubeadm_flags {
        let key = f.split('=').next().unwrap_or(f);
        if !REPLACED.contains(&key) {
            *want.entry(f).or_default() += 1;
        }
    }
    for (flag, n) in &want {
        let have = args.iter().filter(|a| a == flag).count();
        ensure!(
            have == *n,
            "{name}: {flag} {have} times in the Deployment, {n} in kubeadm's pod"
        );
    }
    // And nothing else than the documented changes.
    for a in &args {
        let key = a.split('=').next().unwrap_or(a);
        ensure!(
            want.contains_key(a.as_str()) || REPLACED.contains(&key),
            "{name}: {a} is not kubeadm's and not a documented change"
        );
    }
    ensure!(
        args[..2] == ["--bind-address={{address}}", "--secure-port={{port}}"],
        "{name}: {args:?}"
    );
    ensure!(
        args.contains(&"--endpoint-reconciler-type=none".to_owned()),
        "{name}: reconciler"
    );
    ensure!(
        strings(&c["command"]).contains(&format!("--port={port}")),
        "{name}: launch --port is not {port}: {:?}",
        c["command"]
    );
    ensure!(
        c["image"] == kc["image"],
        "{name}: image {} != {}",
        c["image"],
        kc["image"]
    );
    ensure!(c["resources"] == kc["resources"], "{name}: resources");
    for e in kc["env"].as_array().into_iter().flatten() {
        ensure!(
            c["env"].as_array().is_some_and(|l| l.contains(e)),
            "{name}: env {e} lost"
        );
    }
    // Every volume and mount of kubeadm's, exactly.
    for v in pod["spec"]["volumes"].as_array().into_iter().flatten() {
        ensure!(
            spec["volumes"].as_array().is_some_and(|l| l.contains(v)),
            "{name}: volume {v} lost"
        );
    }
    for m in kc["volumeMounts"].as_array().into_iter().flatten() {
        ensure!(
            c["volumeMounts"].as_array().is_some_and(|l| l.contains(m)),
            "{name}: mount {m} lost"
        );
    }
    // No ports anywhere (host ports under hostNetwork); the sidecar on kubeadm's port.
    for x in spec["containers"].as_array().into_iter().flatten() {
        ensure!(
            x.get("ports").is_none(),
            "{name}: container {} declares ports",
            x["name"]
        );
    }
    let proxy = by_name(&spec["containers"], "proxy").context("no proxy container")?;
    ensure!(
        strings(&proxy["args"]).contains(&format!("--listen=127.0.0.1:{port}")),
        "{name}: the proxy does not serve 127.0.0.1:{port}"
    );
    let labels = &d["spec"]["template"]["metadata"]["labels"];
    ensure!(
        labels.get("component").is_none(),
        "{name}: component label on the Deployment's pods"
    );
    // Valid for the API server, strictly.
    validate_strict(name, &stream)
}

/// `kubernetes-validate --strict` of a YAML stream: valid for the API server.
fn validate_strict(name: &str, stream: &str) -> Result<()> {
    let v = output_with_input(
        Command::new("kubernetes-validate").args(["--strict", "--quiet", "-"]),
        stream,
    )?;
    ensure!(
        v.status.success(),
        "{name}: kubernetes-validate: {}",
        output_text(&v)
    );
    Ok(())
}

#[test]
fn render_real_kubeadm() -> Result<()> {
    let Some(kubeadm) = kubeadm()? else {
        return Ok(());
    };
    if !tools()? {
        return Ok(());
    }
    let tmp = TempDir::new("render")?;
    for (name, port, cluster) in [
        ("plain", 6443, ""),
        ("extra", 6443, EXTRA),
        ("port", 8443, ""),
    ] {
        let dir = tmp.join(name);
        std::fs::create_dir_all(&dir)?;
        let manifest = kubeadm_manifest(&kubeadm, &dir, port, cluster)?;
        check(name, &manifest, &dir, port)?;
    }

    // An older apiserver than the manifest's: exit 2, one line; allowed with --allow-downgrade.
    let file = tmp.join("plain/plain.yaml");
    let older = ["--image", "registry.k8s.io/kube-apiserver:v1.36.3"];
    let out = Command::new(proxy_bin()?)
        .args(["render", "--static-pod"])
        .arg(&file)
        .args(older)
        .output()?;
    let line = bad_input_line(&out, "older --image")?;
    ensure!(line.contains("older than"), "{line}");
    ensure!(out.stdout.is_empty(), "older --image printed something");
    let out = Command::new(proxy_bin()?)
        .args(["render", "--allow-downgrade", "--static-pod"])
        .arg(&file)
        .args(older)
        .output()?;
    ensure!(
        out.status.success(),
        "--allow-downgrade: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(String::from_utf8(out.stdout)?.contains("kube-apiserver:v1.36.3"));

    // --client-address transparent: the component's pod, valid for the API server strictly.
    let out = Command::new(proxy_bin()?)
        .args(["render", "--client-address", "transparent", "--static-pod"])
        .arg(tmp.join("extra/extra.yaml"))
        .output()?;
    ensure!(
        out.status.success(),
        "--client-address transparent: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stream = String::from_utf8(out.stdout)?;
    let docs = yaml_docs(&stream)?;
    let d = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .context("no Deployment")?;
    let spec = &d["spec"]["template"]["spec"];
    let proxy = by_name(&spec["containers"], "proxy").context("no proxy container")?;
    ensure!(
        strings(&proxy["args"]).contains(&"--client-address=transparent".to_owned()),
        "the proxy runs without the mode: {:?}",
        proxy["args"]
    );
    ensure!(
        by_name(&spec["initContainers"], "transparent-routes").is_some(),
        "no transparent-routes init container"
    );
    validate_strict("transparent", &stream)?;

    // A file that is not there: exit 2, one line naming it.
    let out = Command::new(proxy_bin()?)
        .args(["render", "--static-pod"])
        .arg(tmp.join("missing.yaml"))
        .output()?;
    let line = bad_input_line(&out, "a missing --static-pod")?;
    ensure!(line.contains("missing.yaml"), "{line}");
    Ok(())
}
