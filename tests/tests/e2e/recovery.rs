//! Reboot recovery (docs/architecture.md, "Reboot recovery"): the node agent (`recover`) that
//! writes the checkpoint of the Deployment's pod that stayed ready (read over mTLS with the
//! node's kubeconfig), activates it at boot and removes it when asked; and the recovery
//! instance asking to be retired once a ready peer serves (`run --retire-file`). Real
//! processes, real files, real sockets, real TLS; and under `strace`, the checkpoint, the one it
//! replaced and the activated checkpoint written durably, mode 0600 (without strace that test
//! says it is skipped, except in CI, where it fails).

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::client::{ensure_scrapes_refused, http_get, HttpsClient};
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::process::{bad_input_line, ChildProcess};
use kube_apiserver_proxy_tests::proxy::{proxy_bin, require_metric, run_cli, ProxyBuilder};
use kube_apiserver_proxy_tests::strace::{self, Trace};
use kube_apiserver_proxy_tests::util::{eventually, free_random_loopback_addr, skip, TempDir};
use serde_json::{json, Value};

use crate::{listen_addr, DEADLINE};

const PODS_PATH: &str = "/api/v1/namespaces/kube-system/pods";
const RETIRE: &str = "/run/kube-apiserver-proxy/checkpoint-retire";

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The images of the test pods: kubeadm's apiserver repository (allowed by default) and the
/// proxy's (allowed with `--allow-image-repository`, as the agent's manifest does).
const APISERVER_IMAGE: &str = "registry.k8s.io/kube-apiserver:v1.37.2";
const PROXY_IMAGE: &str = "ghcr.io/example/kube-apiserver-proxy:v0.1.0";
const PROXY_REPOSITORY: &str = "ghcr.io/example/kube-apiserver-proxy";
const RS_PATH: &str = "/apis/apps/v1/namespaces/kube-system/replicasets/kube-apiserver-5c9d8";
const DEPLOYMENT_PATH: &str = "/apis/apps/v1/namespaces/kube-system/deployments/kube-apiserver";

/// A pod of the Deployment as the API lists it, created `age` ago, Ready since `ready` ago
/// (never ready: `None`), owned by the ReplicaSet of [`replicaset`].
fn pod(name: &str, age: Duration, ready: Option<Duration>) -> Value {
    let now = SystemTime::now();
    let conditions = match ready {
        Some(r) => {
            json!([{"type": "Ready", "status": "True", "lastTransitionTime": rfc3339(now - r)}])
        }
        None => {
            json!([{"type": "Ready", "status": "False", "lastTransitionTime": rfc3339(now - age)}])
        }
    };
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "kube-system", "uid": format!("uid-{name}"),
            "creationTimestamp": rfc3339(now - age),
            "labels": {"component": "kube-apiserver", "tier": "control-plane", "pod-template-hash": "5c9d8"},
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet",
                "name": "kube-apiserver-5c9d8", "uid": "uid-rs", "controller": true}]},
        "spec": {
            "nodeName": "node-1", "hostNetwork": true,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {"name": "kube-apiserver", "image": APISERVER_IMAGE,
                 "args": [format!("--etcd-servers=https://127.0.0.1:2379/{name}")]},
                {"name": "proxy", "image": PROXY_IMAGE, "command": ["/kube-apiserver-proxy", "run"],
                 "args": ["--handoff-dir=/run/kube-apiserver-proxy/handoff"],
                 "securityContext": {"capabilities": {"drop": ["ALL"]}}}
            ]
        },
        "status": {"phase": "Running", "conditions": conditions}
    })
}

/// The pods' ReplicaSet, controlled by `deployment/DEPLOYMENT` (uid `uid-DEPLOYMENT`).
fn replicaset(deployment: &str) -> Value {
    json!({"apiVersion": "apps/v1", "kind": "ReplicaSet",
        "metadata": {"name": "kube-apiserver-5c9d8", "namespace": "kube-system", "uid": "uid-rs",
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                "name": deployment, "uid": format!("uid-{deployment}"), "controller": true}]}})
}

fn deployment() -> Value {
    json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "kube-apiserver", "namespace": "kube-system", "uid": "uid-kube-apiserver"}})
}

/// A checkpoint directory, and an apiserver listing `pods` (and their owners) to the node's
/// client certificate.
struct Api {
    pki: Pki,
    fake: FakeApiserver,
    dir: TempDir,
    metrics: SocketAddr,
}

impl Api {
    async fn new(pods: &[Value]) -> Result<Self> {
        Self::with_owners(
            pods,
            &[
                (RS_PATH, replicaset("kube-apiserver")),
                (DEPLOYMENT_PATH, deployment()),
            ],
        )
        .await
    }

    async fn with_owners(pods: &[Value], owners: &[(&str, Value)]) -> Result<Self> {
        let pki = Pki::new()?;
        // Kubeconfigs name the apiserver by IP: the serving certificate has it.
        let ip = kube_apiserver_proxy_tests::util::random_loopback_ip()?;
        let serving = pki.ca.server_cert(&["kubernetes", &ip.to_string()])?;
        let mut fake =
            FakeApiserver::https_with_identity(serving.cert_chain(), serving.private_key())
                .bind(SocketAddr::new(ip, 0))
                .require_client_cert(pki.ca.root_store()?)
                .object(PODS_PATH, &json!({"kind": "PodList", "items": pods}));
        for (path, object) in owners {
            fake = fake.object(path, object);
        }
        let fake = fake.start().await?;
        let dir = TempDir::new("writer")?;
        std::fs::create_dir(dir.join("manifests"))?;
        // The agent's first start this boot is over: only the writer runs.
        std::fs::write(dir.join("boot"), "not activated: test\n")?;
        // kubeadm's kubelet.conf names the rotated certificate by path.
        std::fs::write(
            dir.join("kubelet.conf"),
            format!(
                "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority: {}\n    server: https://{}\n  name: c\nusers:\n- name: system:node:node-1\n  user:\n    client-certificate: {}\n    client-key: {}\n",
                pki.ca_file().display(),
                fake.addr(),
                pki.client_cert_file().display(),
                pki.client_key_file().display()
            ),
        )?;
        Ok(Self {
            pki,
            fake,
            dir,
            metrics: free_random_loopback_addr()?,
        })
    }

    fn checkpoint_dir(&self) -> PathBuf {
        self.dir.join("checkpoint")
    }

    fn checkpoint(&self) -> PathBuf {
        self.checkpoint_dir().join("kube-apiserver.json")
    }

    /// The agent writing checkpoints into `dir` (reading from this apiserver), with the
    /// manifest's image allow-list.
    fn agent(&self, dir: &Path) -> Result<ChildProcess> {
        self.agent_with(
            dir,
            &[&format!("--allow-image-repository={PROXY_REPOSITORY}")],
        )
    }

    fn agent_with(&self, dir: &Path, extra: &[&str]) -> Result<ChildProcess> {
        ChildProcess::spawn(self.agent_command(dir, extra)?, "recover")
    }

    fn agent_command(&self, dir: &Path, extra: &[&str]) -> Result<Command> {
        let mut command = Command::new(proxy_bin()?);
        command
            .arg("recover")
            .arg(format!("--node-address={}", free_random_loopback_addr()?))
            .arg("--node-name=node-1")
            .arg("--kubeconfig")
            .arg(self.dir.join("kubelet.conf"))
            .arg("--checkpoint-dir")
            .arg(dir)
            .arg("--static-pod-dir")
            .arg(self.dir.join("manifests"))
            .arg(format!("--retire-file={RETIRE}"))
            .arg("--boot-marker")
            .arg(self.dir.join("boot"))
            .arg(format!("--metrics-listen={}", self.metrics))
            .args(["--interval=100ms", "--checkpoint-interval=200ms"])
            .arg("--checkpoint-after=60s")
            .args(extra)
            .env_remove("RUST_LOG");
        Ok(command)
    }

    /// A metric of the agent: every one is exported from the start (the attempts with each
    /// result too), so a missing one is an error, not 0.
    async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
        let (status, text) = http_get(self.metrics, "/metrics").await?;
        ensure!(status == 200, "GET /metrics: {status}");
        require_metric(&text, name, labels)
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))
}

fn checkpoint_of(path: &Path) -> Option<String> {
    read_json(path).ok()?["metadata"]["annotations"]["kube-apiserver-proxy/checkpoint-of"]
        .as_str()
        .map(str::to_owned)
}

async fn wait_log(agent: &ChildProcess, text: &str) -> Result<()> {
    eventually(DEADLINE, || async {
        agent.ensure_running()?;
        ensure!(
            agent.stderr().contains(text),
            "no {text:?} yet: {}",
            agent.stderr()
        );
        Ok(())
    })
    .await
}

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test]
async fn the_checkpoint_is_the_newest_pod_that_stayed_ready() -> Result<()> {
    // A good pod, ready for an hour; a broken rollout's pod, newer, never ready.
    let good = pod("good", MINUTE * 90, Some(MINUTE * 60));
    let broken = pod("broken", MINUTE * 30, None);
    let api = Api::new(&[good.clone(), broken.clone()]).await?;
    let dir = api.checkpoint_dir();
    let agent = api.agent(&dir)?;
    eventually(DEADLINE, || async {
        agent.ensure_running()?;
        ensure!(
            checkpoint_of(&api.checkpoint()).as_deref() == Some("kube-system/good"),
            "checkpoint of {:?}; log: {}",
            checkpoint_of(&api.checkpoint()),
            agent.stderr()
        );
        Ok(())
    })
    .await?;
    let c = read_json(&api.checkpoint())?;
    ensure!(c["metadata"]["name"] == "kube-apiserver-checkpoint", "{c}");
    ensure!(
        c["spec"]["containers"][0]["args"] == json!(["--etcd-servers=https://127.0.0.1:2379/good"]),
        "{c}"
    );
    ensure!(
        c["spec"]["containers"][1]["args"]
            == json!([
                "--handoff-dir=/run/kube-apiserver-proxy/handoff",
                format!("--retire-file={RETIRE}")
            ]),
        "the recovery instance's proxy: {c}"
    );
    ensure!(api.fake.requests(PODS_PATH) >= 1);
    // Read with the node's client certificate (the fake requires one; it was accepted).
    ensure!(!dir.join("kube-apiserver.previous.json").exists());
    // It stays: the same pod is the checkpoint at every later poll.
    wait_log(&agent, "this pod is already the checkpoint").await?;
    drop(agent);

    // The broken pod has been alive for 30 minutes: never ready, never the checkpoint. A new
    // pod ready for 30 s only is not either (--checkpoint-after=60s).
    let young = pod("young", MINUTE, Some(Duration::from_secs(30)));
    let api2 = Api::new(&[good.clone(), broken.clone(), young]).await?;
    let agent = api2.agent(&dir)?;
    wait_log(&agent, "this pod is already the checkpoint").await?;
    ensure!(checkpoint_of(&api.checkpoint()).as_deref() == Some("kube-system/good"));
    drop(agent);

    // Once a newer pod has been ready for the wait, it is the checkpoint; the good one is kept
    // as the previous.
    let newer = pod("newer", MINUTE * 5, Some(MINUTE * 2));
    let api3 = Api::new(&[good.clone(), broken, newer]).await?;
    let agent = api3.agent(&dir)?;
    wait_log(&agent, "checkpoint written").await?;
    ensure!(checkpoint_of(&api.checkpoint()).as_deref() == Some("kube-system/newer"));
    ensure!(
        checkpoint_of(&dir.join("kube-apiserver.previous.json")).as_deref()
            == Some("kube-system/good")
    );
    drop(agent);

    // The old pod alone (its successor gone from the list, e.g. being deleted) never replaces
    // the newer pod's checkpoint.
    let api4 = Api::new(&[good]).await?;
    let agent = api4.agent(&dir)?;
    wait_log(&agent, "the checkpoint is of a newer pod").await?;
    ensure!(checkpoint_of(&api.checkpoint()).as_deref() == Some("kube-system/newer"));
    drop((api2, api3, api4));
    Ok(())
}

/// Waits until the agent's metric reaches `want`.
async fn wait_metric(
    api: &Api,
    agent: &ChildProcess,
    name: &str,
    labels: &[(&str, &str)],
    want: impl Fn(f64) -> bool,
) -> Result<f64> {
    eventually(DEADLINE, || async {
        agent.ensure_running()?;
        let v = api.metric(name, labels).await?;
        ensure!(want(v), "{name}{labels:?} = {v}; log: {}", agent.stderr());
        Ok(v)
    })
    .await
}

/// The checks `recover` makes before activating a checkpoint are made before writing one: a
/// pod that the boot would refuse, or that is not the told workload's, is never written; the
/// good checkpoint stays, and the agent's metrics say so.
#[tokio::test]
async fn a_pod_the_boot_would_refuse_is_never_the_checkpoint() -> Result<()> {
    let good = pod("good", MINUTE * 90, Some(MINUTE * 60));
    let api = Api::new(std::slice::from_ref(&good)).await?;
    let dir = api.checkpoint_dir();
    let agent = api.agent(&dir)?;
    wait_log(&agent, "checkpoint written").await?;
    let written = wait_metric(
        &api,
        &agent,
        "checkpoint_written_timestamp_seconds",
        &[],
        |v| v > 0.0,
    )
    .await?;
    let at = read_json(&api.checkpoint())?["metadata"]["annotations"]
        ["kube-apiserver-proxy/checkpointed-at"]
        .as_str()
        .map(humantime::parse_rfc3339)
        .context("checkpointed-at")??;
    ensure!(
        written == at.duration_since(SystemTime::UNIX_EPOCH)?.as_secs() as f64,
        "written {written}, annotation {at:?}"
    );
    // Verified again at every attempt while it is current.
    let verified = wait_metric(
        &api,
        &agent,
        "checkpoint_verified_timestamp_seconds",
        &[],
        |v| v >= written,
    )
    .await?;
    ensure!(api.metric("checkpoint_refused", &[]).await? == 0.0);
    drop(agent);
    let good_file = std::fs::read(api.checkpoint())?;

    // A newer pod, ready for long enough, each time with one thing the boot refuses or that is
    // not the Deployment's.
    let checkpoint_dir = dir.display().to_string();
    type Break = Box<dyn Fn(&mut Value)>;
    type Owners = Vec<(&'static str, Value)>;
    let cases: Vec<(&str, Break, Owners)> = vec![
        (
            "which is or holds",
            Box::new(move |p: &mut Value| {
                p["spec"]["volumes"] = json!([{"name": "x", "hostPath": {"path": checkpoint_dir}}])
            }),
            vec![
                (RS_PATH, replicaset("kube-apiserver")),
                (DEPLOYMENT_PATH, deployment()),
            ],
        ),
        (
            "adds capabilities (SYS_ADMIN)",
            Box::new(|p: &mut Value| {
                p["spec"]["containers"][0]["securityContext"] =
                    json!({"capabilities": {"add": ["SYS_ADMIN"]}})
            }),
            vec![
                (RS_PATH, replicaset("kube-apiserver")),
                (DEPLOYMENT_PATH, deployment()),
            ],
        ),
        (
            "seccomp profile Unconfined",
            Box::new(|p: &mut Value| {
                p["spec"]["securityContext"]["seccompProfile"]["type"] = json!("Unconfined")
            }),
            vec![
                (RS_PATH, replicaset("kube-apiserver")),
                (DEPLOYMENT_PATH, deployment()),
            ],
        ),
        (
            "not from an allowed repository",
            Box::new(|p: &mut Value| {
                p["spec"]["containers"][0]["image"] = json!("registry.example/kube-apiserver:v1")
            }),
            vec![
                (RS_PATH, replicaset("kube-apiserver")),
                (DEPLOYMENT_PATH, deployment()),
            ],
        ),
        (
            "no controller owner reference",
            Box::new(|p: &mut Value| {
                p["metadata"]
                    .as_object_mut()
                    .unwrap()
                    .remove("ownerReferences");
            }),
            vec![],
        ),
        (
            "belongs to deployment/impostor",
            Box::new(|_: &mut Value| {}),
            vec![
                (RS_PATH, replicaset("impostor")),
                (
                    "/apis/apps/v1/namespaces/kube-system/deployments/impostor",
                    deployment(),
                ),
            ],
        ),
        (
            "has another uid than the owner reference names",
            Box::new(|_: &mut Value| {}),
            vec![
                (RS_PATH, replicaset("kube-apiserver")),
                (
                    DEPLOYMENT_PATH,
                    json!({"kind": "Deployment", "metadata": {"name": "kube-apiserver", "uid": "recreated"}}),
                ),
            ],
        ),
        (
            "replicasets/kube-apiserver-5c9d8 does not exist",
            Box::new(|_: &mut Value| {}),
            vec![(DEPLOYMENT_PATH, deployment())],
        ),
    ];
    for (why, break_it, owners) in cases {
        let mut newer = pod("newer", MINUTE * 5, Some(MINUTE * 2));
        break_it(&mut newer);
        let api = Api::with_owners(&[good.clone(), newer], &owners).await?;
        let agent = api.agent(&dir)?;
        wait_log(&agent, "checkpoint refused: pod kube-system/newer").await?;
        ensure!(agent.stderr().contains(why), "{why}: {}", agent.stderr());
        wait_metric(&api, &agent, "checkpoint_refused", &[], |v| v == 1.0).await?;
        ensure!(
            api.metric("checkpoint_attempts_total", &[("result", "refused")])
                .await?
                >= 1.0
        );
        ensure!(
            api.metric("checkpoint_attempts_total", &[("result", "written")])
                .await?
                == 0.0
        );
        // Not verified: the alert on its age fires if this lasts.
        ensure!(
            api.metric("checkpoint_verified_timestamp_seconds", &[])
                .await?
                == 0.0
        );
        ensure!(
            std::fs::read(api.checkpoint_dir().join("kube-apiserver.json"))
                .ok()
                .is_none()
                && std::fs::read(dir.join("kube-apiserver.json"))? == good_file,
            "{why}: the checkpoint changed"
        );
        ensure!(
            !dir.join("kube-apiserver.previous.json").exists(),
            "{why}: replaced"
        );
    }

    // The checkpoint kept must pass the rules of the boot too: without the proxy's repository
    // the boot would refuse it, and the agent says so now rather than at the next reboot.
    let api = Api::new(&[good]).await?;
    let agent = api.agent_with(&dir, &[])?;
    wait_log(&agent, "would be refused at boot").await?;
    wait_metric(&api, &agent, "checkpoint_refused", &[], |v| v == 1.0).await?;
    ensure!(
        agent
            .stderr()
            .contains("ghcr.io/example/kube-apiserver-proxy:v0.1.0"),
        "{}",
        agent.stderr()
    );
    ensure!(
        api.metric("checkpoint_written_timestamp_seconds", &[])
            .await?
            == written
    );
    ensure!(verified >= written);
    Ok(())
}

/// The kubelet rotates its client certificate (kubeadm's kubelet.conf names
/// `kubelet-client-current.pem`, a link the kubelet moves); once the old one is refused (it
/// expired), the agent must present the new one.
#[tokio::test]
async fn a_rotated_client_certificate_is_used_at_the_next_attempt() -> Result<()> {
    let good = pod("good", MINUTE * 90, Some(MINUTE * 60));
    let api = Api::new(std::slice::from_ref(&good)).await?;
    let pki_dir = api.dir.join("pki");
    std::fs::create_dir(&pki_dir)?;
    let issue = |n: u32| -> Result<(PathBuf, rustls::pki_types::CertificateDer<'static>)> {
        let cert = api.pki.ca.client_cert("system:node:node-1")?;
        let (c, k) = cert.write_pem(&pki_dir, &format!("part-{n}"))?;
        let file = pki_dir.join(format!("kubelet-client-{n}.pem"));
        std::fs::write(
            &file,
            std::fs::read_to_string(c)? + &std::fs::read_to_string(k)?,
        )?;
        Ok((file, cert.cert_chain()[0].clone()))
    };
    let current = pki_dir.join("kubelet-client-current.pem");
    let (first, first_der) = issue(1)?;
    std::os::unix::fs::symlink(&first, &current)?;
    let conf = std::fs::read_to_string(api.dir.join("kubelet.conf"))?
        .replace(
            &api.pki.client_cert_file().display().to_string(),
            &current.display().to_string(),
        )
        .replace(
            &api.pki.client_key_file().display().to_string(),
            &current.display().to_string(),
        );
    std::fs::write(api.dir.join("kubelet.conf"), conf)?;
    let agent = api.agent(&api.checkpoint_dir())?;
    wait_log(&agent, "checkpoint written").await?;

    // The rotation, as the kubelet does it; then the old certificate is refused.
    let (second, _) = issue(2)?;
    let link = pki_dir.join("link.tmp");
    std::os::unix::fs::symlink(&second, &link)?;
    std::fs::rename(&link, &current)?;
    api.fake.revoke_client_cert(&first_der);
    // A rollout's new pod: it is written only if the agent reads with the new certificate.
    let newer = pod("newer", MINUTE * 5, Some(MINUTE * 2));
    api.fake.set_object(
        PODS_PATH,
        &json!({"kind": "PodList", "items": [good, newer]}),
    );
    eventually(DEADLINE, || async {
        agent.ensure_running()?;
        ensure!(
            checkpoint_of(&api.checkpoint()).as_deref() == Some("kube-system/newer"),
            "checkpoint of {:?}; log: {}",
            checkpoint_of(&api.checkpoint()),
            agent.stderr()
        );
        Ok(())
    })
    .await?;
    ensure!(
        api.metric("checkpoint_attempts_total", &[("result", "written")])
            .await?
            == 2.0
    );
    Ok(())
}

#[tokio::test]
async fn a_refused_client_certificate_writes_nothing() -> Result<()> {
    let api = Api::new(&[pod("good", MINUTE * 90, Some(MINUTE * 60))]).await?;
    // The kubeconfig presents a certificate of another CA: the apiserver refuses the handshake.
    let other = Pki::new()?;
    let conf = std::fs::read_to_string(api.dir.join("kubelet.conf"))?
        .replace(
            &api.pki.client_cert_file().display().to_string(),
            &other.client_cert_file().display().to_string(),
        )
        .replace(
            &api.pki.client_key_file().display().to_string(),
            &other.client_key_file().display().to_string(),
        );
    std::fs::write(api.dir.join("kubelet.conf"), conf)?;
    let agent = api.agent(&api.checkpoint_dir())?;
    wait_log(&agent, "checkpoint not written").await?;
    ensure!(
        !api.checkpoint().exists(),
        "written with a refused identity"
    );
    Ok(())
}

/// A failure at run time is not bad input: the metrics address is taken by someone else
/// (the flag itself is valid) and `recover` exits 1, with one line naming it.
#[tokio::test]
async fn recover_exits_1_when_it_fails_at_run_time() -> Result<()> {
    let dir = TempDir::new("recover-runtime")?;
    let taken = TcpListener::bind("127.0.0.1:0")?;
    let addr = taken.local_addr()?;
    let out = run_cli([
        "recover".to_owned(),
        "--node-address=127.0.0.1:6443".to_owned(),
        format!("--static-pod-dir={}", dir.path().display()),
        format!("--metrics-listen={addr}"),
    ])
    .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.code() == Some(1), "{:?} {stderr}", out.status);
    let line = stderr
        .lines()
        .find(|l| l.starts_with("error: recover: "))
        .with_context(|| format!("no error line: {stderr}"))?;
    ensure!(
        line.contains(&format!("--metrics-listen: bind {addr}: ")),
        "{stderr}"
    );
    drop(taken);
    Ok(())
}

#[tokio::test]
async fn recover_flags_are_checked_before_anything_starts() -> Result<()> {
    let dir = TempDir::new("recover-flags")?;
    std::fs::write(dir.join("bad.conf"), "clusters: []\n")?;
    for (args, expect) in [
        (
            vec!["recover".to_owned(), "--node-address=nope".to_owned()],
            "--node-address",
        ),
        (
            vec![
                "recover".to_owned(),
                "--node-address=127.0.0.1:6443".to_owned(),
                format!("--static-pod-dir={}", dir.join("missing").display()),
            ],
            "--static-pod-dir",
        ),
        (
            vec![
                "recover".to_owned(),
                "--node-address=127.0.0.1:6443".to_owned(),
                format!("--kubeconfig={}", dir.join("bad.conf").display()),
            ],
            "--node-name",
        ),
        (
            vec![
                "recover".to_owned(),
                "--node-address=127.0.0.1:6443".to_owned(),
                format!("--static-pod-dir={}", dir.path().display()),
                "--node-name=n".to_owned(),
                format!("--kubeconfig={}", dir.join("bad.conf").display()),
            ],
            "no server",
        ),
        (
            vec![
                "recover".to_owned(),
                "--node-address=127.0.0.1:6443".to_owned(),
                format!("--static-pod-dir={}", dir.path().display()),
                "--workload=statefulset/x".to_owned(),
            ],
            "--workload",
        ),
        (
            vec![
                "recover".to_owned(),
                "--node-address=127.0.0.1:6443".to_owned(),
                format!("--static-pod-dir={}", dir.path().display()),
                "--allow-host-path=var/log".to_owned(),
            ],
            "--allow-host-path var/log",
        ),
        (
            vec![
                "recover".to_owned(),
                "--node-address=127.0.0.1:6443".to_owned(),
                format!("--static-pod-dir={}", dir.path().display()),
                "--allow-image-repository=registry.example/proxy:v1".to_owned(),
            ],
            "--allow-image-repository",
        ),
    ] {
        let out = run_cli(&args).await?;
        let line = bad_input_line(&out, &format!("{args:?}"))?;
        ensure!(line.contains(expect), "{args:?}: {line}");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The recovery instance and the node agent
// ---------------------------------------------------------------------------------------------

#[tokio::test]
async fn recovery_instance_asks_to_retire_once_a_ready_peer_serves() -> Result<()> {
    let pki = Pki::new()?;
    let node = TempDir::new("retire")?;
    let handoff = node.join("handoff");
    let retire = node.join("retire");
    let listen = listen_addr()?;
    let fake_a = crate::https_backend(&pki).await?;
    let fake_b = crate::https_backend_unready(&pki).await?;
    let instance = |own: SocketAddr, name: &str| -> Result<ProxyBuilder> {
        let file = node.join(name);
        std::fs::write(&file, own.to_string())?;
        Ok(ProxyBuilder::new()
            .listen(listen)
            .health_check("https")
            .ca_file(&pki.ca_file())
            .fast_health()
            .arg("--own-backend-file")
            .arg(file)
            .arg("--handoff-dir")
            .arg(&handoff))
    };
    // The recovery instance, alone: serves, asks for nothing.
    let recovery = instance(fake_a.addr(), "a")?
        .arg("--retire-file")
        .arg(&retire)
        .spawn()
        .await?;
    recovery.wait_state("Serving").await?;
    // The Deployment's pod beside it: Serving (the recovery instance's apiserver is a
    // backend), not ready while its own apiserver is not.
    let deployment = instance(fake_b.addr(), "b")?
        .backend(fake_a.addr())
        .spawn()
        .await?;
    deployment.wait_state("Serving").await?;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        recovery.ensure_running()?;
        ensure!(!retire.exists(), "retirement asked while no peer is ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    fake_b.set_ready(true);
    eventually(DEADLINE, || async {
        recovery.ensure_running()?;
        ensure!(retire.exists(), "no retire request yet");
        Ok(())
    })
    .await?;
    ensure!(
        recovery
            .metric_or_zero("retire_requests_total", &[])
            .await?
            == 1.0
    );
    // What follows at the node: the recovery pod is stopped; its socket goes to the ready peer.
    recovery.sigterm()?;
    let status = recovery.wait_exit(DEADLINE).await?;
    ensure!(status.success(), "recovery instance exit: {status}");
    ensure!(
        deployment
            .metric_or_zero(
                "handoffs_total",
                &[("direction", "adopt_received"), ("result", "ok")]
            )
            .await?
            == 1.0,
        "the ready peer did not adopt the recovery instance's socket"
    );
    ensure!(
        !kube_apiserver_proxy_tests::util::connection_refused(listen).await,
        "{listen} refuses after the recovery instance left"
    );
    Ok(())
}

/// A checkpoint as the writer makes it (enough for `recover`'s checks), mounting `host_paths`.
fn checkpoint_of_paths(host_paths: &[&str]) -> Value {
    let volumes: Vec<Value> = host_paths
        .iter()
        .enumerate()
        .map(|(i, p)| json!({"name": format!("v{i}"), "hostPath": {"path": p}}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "kube-apiserver-checkpoint", "namespace": "kube-system",
            "annotations": {"kube-apiserver-proxy/checkpoint-of": "kube-system/good",
                "kube-apiserver-proxy/checkpoint-of-uid": "u",
                "kube-apiserver-proxy/checkpoint-of-created": "2025-01-01T00:00:00Z",
                "kube-apiserver-proxy/checkpointed-at": "2025-01-01T00:01:00Z"}},
        "spec": {"hostNetwork": true,
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "kube-apiserver", "image": APISERVER_IMAGE}],
            "volumes": volumes}})
}

fn checkpoint(host_path: &str) -> Value {
    checkpoint_of_paths(&[host_path])
}

/// The agent's node: static pod directory, checkpoint, retire file, boot marker.
struct AgentNode {
    dir: TempDir,
    address: SocketAddr,
}

impl AgentNode {
    fn new(checkpoint: &Value) -> Result<Self> {
        let dir = TempDir::new("recover")?;
        std::fs::create_dir(dir.join("manifests"))?;
        std::fs::create_dir(dir.join("checkpoint"))?;
        std::fs::write(
            dir.join("checkpoint/kube-apiserver.json"),
            checkpoint.to_string(),
        )?;
        Ok(Self {
            dir,
            address: free_random_loopback_addr()?,
        })
    }

    fn manifest(&self) -> PathBuf {
        self.dir.join("manifests/kube-apiserver-checkpoint.json")
    }

    fn marker(&self) -> PathBuf {
        self.dir.join("boot")
    }

    /// kubeadm's apiserver manifest (absent unless a test writes it).
    fn kubeadm_manifest(&self) -> PathBuf {
        self.dir.join("kubeadm-kube-apiserver.yaml")
    }

    fn retire(&self) -> PathBuf {
        self.dir.join("retire")
    }

    /// Starts `recover` and waits until it made (or skipped) this boot's decision.
    async fn agent(&self) -> Result<ChildProcess> {
        self.agent_with(&[]).await
    }

    async fn agent_with(&self, extra: &[&str]) -> Result<ChildProcess> {
        let agent = ChildProcess::spawn(self.command(extra)?, "recover")?;
        self.decided(&agent).await?;
        Ok(agent)
    }

    /// The agent's command line.
    fn command(&self, extra: &[&str]) -> Result<Command> {
        let mut command = Command::new(proxy_bin()?);
        command
            .arg("recover")
            .arg(format!("--node-address={}", self.address))
            .arg("--checkpoint-dir")
            .arg(self.dir.join("checkpoint"))
            .arg("--static-pod-dir")
            .arg(self.dir.join("manifests"))
            .arg("--retire-file")
            .arg(self.retire())
            .arg("--boot-marker")
            .arg(self.marker())
            .arg("--kubeadm-manifest")
            .arg(self.kubeadm_manifest())
            .arg("--interval=100ms")
            .args(extra)
            .env_remove("RUST_LOG");
        Ok(command)
    }

    /// Waits until `agent` made (or skipped) this boot's decision.
    async fn decided(&self, agent: &ChildProcess) -> Result<()> {
        eventually(DEADLINE, || async {
            agent.ensure_running()?;
            let log = agent.stderr();
            ensure!(
                self.marker().exists()
                    && log.contains("recover: started")
                    && (log.contains("checkpoint activated")
                        || log.contains("not activated")
                        || log.contains("not the first start")),
                "no decision yet: {log}"
            );
            Ok(())
        })
        .await
    }

    fn marker_text(&self) -> String {
        std::fs::read_to_string(self.marker()).unwrap_or_default()
    }
}

#[tokio::test]
async fn recover_activates_at_boot_when_nothing_serves_and_removes_when_asked() -> Result<()> {
    let node = AgentNode::new(&checkpoint("/etc/kubernetes/pki"))?;
    std::fs::write(node.retire(), "stale, from before the boot")?;
    let agent = node.agent().await?;
    ensure!(
        node.marker_text().starts_with("activated kube-system/good"),
        "marker: {}",
        node.marker_text()
    );
    ensure!(
        std::fs::read(node.manifest())?
            == std::fs::read(node.dir.join("checkpoint/kube-apiserver.json"))?,
        "the activated manifest is not the checkpoint"
    );
    // The stale request from before the boot did not end the recovery at once.
    ensure!(node.manifest().exists() && !node.retire().exists());

    // The recovery instance asks: manifest and request go.
    std::fs::write(node.retire(), "{}")?;
    eventually(DEADLINE, || async {
        agent.ensure_running()?;
        ensure!(!node.manifest().exists(), "manifest still there");
        ensure!(!node.retire().exists(), "request still there");
        Ok(())
    })
    .await?;
    agent.signal(nix::sys::signal::Signal::SIGTERM)?;
    let status = agent.wait_exit(DEADLINE).await?;
    ensure!(status.success(), "recover exit {status}");

    // A restart of the agent (or of the kubelet) in the same boot decides nothing.
    let again = node.agent().await?;
    ensure!(again.stderr().contains("not the first start since boot"));
    ensure!(!node.manifest().exists(), "activated twice in one boot");
    Ok(())
}

#[tokio::test]
async fn recover_does_not_activate_when_the_node_serves_or_the_checkpoint_is_refused() -> Result<()>
{
    // Something serves the node address (e.g. kubeadm's static apiserver).
    let node = AgentNode::new(&checkpoint("/etc/kubernetes/pki"))?;
    let _serving = TcpListener::bind(node.address)?;
    let _agent = node.agent().await?;
    ensure!(
        node.marker_text().contains("accepts connections"),
        "marker: {}",
        node.marker_text()
    );
    ensure!(
        !node.manifest().exists(),
        "activated beside a serving apiserver"
    );

    // A checkpoint that mounts the host's root (not what an apiserver pod needs).
    let node = AgentNode::new(&checkpoint("/"))?;
    let _agent = node.agent().await?;
    ensure!(
        node.marker_text().contains("refused") && node.marker_text().contains("host path /"),
        "marker: {}",
        node.marker_text()
    );
    ensure!(
        !node.manifest().exists(),
        "a refused checkpoint was activated"
    );

    // Checkpoints that break one of the other rules of the boot (the writer applies the same).
    type Break = fn(&mut Value);
    let cases: [(&str, Break); 3] = [
        ("adds capabilities (NET_ADMIN)", |c| {
            c["spec"]["containers"][0]["securityContext"] =
                json!({"capabilities": {"add": ["NET_ADMIN"]}})
        }),
        ("seccomp profile Unconfined", |c| {
            c["spec"]["securityContext"]["seccompProfile"]["type"] = json!("Unconfined")
        }),
        ("not from an allowed repository", |c| {
            c["spec"]["containers"][0]["image"] = json!("registry.example/x:1")
        }),
    ];
    for (why, break_it) in cases {
        let mut c = checkpoint("/etc/kubernetes/pki");
        break_it(&mut c);
        let node = AgentNode::new(&c)?;
        let _agent = node.agent().await?;
        ensure!(
            node.marker_text().contains("refused") && node.marker_text().contains(why),
            "{why}: marker: {}",
            node.marker_text()
        );
        ensure!(!node.manifest().exists(), "{why}: activated");
    }
    // The checkpoint directory itself is never mountable, even when allowed by hand.
    let node = AgentNode::new(&checkpoint("/var/lib/kube-apiserver-proxy"))?;
    let protected = node.dir.join("checkpoint").display().to_string();
    std::fs::write(
        node.dir.join("checkpoint/kube-apiserver.json"),
        checkpoint(&protected).to_string(),
    )?;
    let _agent = node
        .agent_with(&[&format!("--allow-host-path={}", node.dir.path().display())])
        .await?;
    ensure!(
        node.marker_text()
            .contains(&format!("which is or holds {protected}")),
        "marker: {}",
        node.marker_text()
    );
    ensure!(
        !node.manifest().exists(),
        "a checkpoint mounting the checkpoint directory was activated"
    );
    // Nor kubeadm's manifest directory (kubeadm-sync copies it into the kubelet's), whatever the
    // static pod directory is.
    let node = AgentNode::new(&checkpoint("/etc/kubernetes"))?;
    let _agent = node
        .agent_with(&["--allow-host-path=/etc/kubernetes"])
        .await?;
    ensure!(
        node.marker_text()
            .contains("which is or holds /etc/kubernetes/manifests"),
        "marker: {}",
        node.marker_text()
    );

    // No checkpoint at all.
    let node = AgentNode::new(&checkpoint("/etc/kubernetes/pki"))?;
    std::fs::remove_file(node.dir.join("checkpoint/kube-apiserver.json"))?;
    let _agent = node.agent().await?;
    ensure!(
        node.marker_text().contains("no checkpoint"),
        "{}",
        node.marker_text()
    );
    Ok(())
}

/// At boot a checkpoint more than one minor version behind kubeadm's manifest (the node was
/// upgraded twice since it was written) is not activated, unless `--allow-version-skew`; one
/// minor behind (an upgrade whose new pod never became the checkpoint) is.
#[tokio::test]
async fn a_checkpoint_two_minors_behind_kubeadm_is_not_activated() -> Result<()> {
    let kubeadm = |version: &str| {
        format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: kube-apiserver\n  namespace: kube-system\nspec:\n  containers:\n  - name: kube-apiserver\n    image: registry.k8s.io/kube-apiserver:{version}\n    command: [kube-apiserver, --secure-port=6443]\n"
        )
    };
    // The checkpoint runs v1.37.2 (APISERVER_IMAGE).
    let node = AgentNode::new(&checkpoint("/etc/kubernetes/pki"))?;
    std::fs::write(node.kubeadm_manifest(), kubeadm("v1.39.0"))?;
    let _agent = node.agent().await?;
    ensure!(
        node.marker_text()
            .contains("more than one minor version behind")
            && node.marker_text().contains("v1.39.0"),
        "marker: {}",
        node.marker_text()
    );
    ensure!(
        !node.manifest().exists(),
        "a checkpoint two minors behind was activated"
    );

    let node = AgentNode::new(&checkpoint("/etc/kubernetes/pki"))?;
    std::fs::write(node.kubeadm_manifest(), kubeadm("v1.39.0"))?;
    let _agent = node.agent_with(&["--allow-version-skew"]).await?;
    ensure!(
        node.manifest().exists(),
        "not activated with --allow-version-skew: {}",
        node.marker_text()
    );

    let node = AgentNode::new(&checkpoint("/etc/kubernetes/pki"))?;
    std::fs::write(node.kubeadm_manifest(), kubeadm("v1.38.1"))?;
    let _agent = node.agent().await?;
    ensure!(
        node.manifest().exists(),
        "one minor behind was not activated: {}",
        node.marker_text()
    );
    Ok(())
}

/// `--allow-host-path` adds to the default paths (what docs/runbooks/reboot-recovery.md says): a
/// checkpoint that mounts kubeadm's PKI and an audit log directory given with the flag is
/// activated.
#[tokio::test]
async fn allowed_host_paths_add_to_the_defaults() -> Result<()> {
    let audit = "/var/log/kubernetes/audit";
    let node = AgentNode::new(&checkpoint_of_paths(&["/etc/kubernetes/pki", audit]))?;
    let _agent = node
        .agent_with(&[&format!("--allow-host-path={audit}")])
        .await?;
    ensure!(
        node.marker_text().starts_with("activated kube-system/good"),
        "marker: {}",
        node.marker_text()
    );
    // Without the flag the audit directory is refused, by name.
    let node = AgentNode::new(&checkpoint_of_paths(&["/etc/kubernetes/pki", audit]))?;
    let _agent = node.agent().await?;
    ensure!(
        node.marker_text().contains(&format!(
            "mounts host path {audit}, not under an allowed path"
        )),
        "marker: {}",
        node.marker_text()
    );
    // And --help says so.
    let out = run_cli(&["recover", "--help"]).await?;
    let help = String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    ensure!(
        help.contains("A further host path a checkpoint may mount, ADDED to the defaults")
            && help.contains("/etc/kubernetes/pki"),
        "{help}"
    );
    Ok(())
}

/// A power loss leaves the files of reboot recovery whole: the checkpoint, the one it replaced
/// and the checkpoint activated at boot are each a temporary file created 0600, written and
/// fsynced, renamed into place, and then the directory fsynced (seen with strace).
#[tokio::test]
async fn the_checkpoint_and_its_activation_are_written_durably() -> Result<()> {
    if let Err(reason) = strace::usable() {
        return skip(
            "the_checkpoint_and_its_activation_are_written_durably",
            &reason,
        );
    }
    let mode =
        |path: &Path| -> Result<u32> { Ok(std::fs::metadata(path)?.permissions().mode() & 0o7777) };
    // A checkpoint; then, under strace, a newer pod's, the first kept as the previous.
    let good = pod("good", MINUTE * 90, Some(MINUTE * 60));
    let api = Api::new(std::slice::from_ref(&good)).await?;
    let dir = api.checkpoint_dir();
    let agent = api.agent(&dir)?;
    wait_log(&agent, "checkpoint written").await?;
    drop(agent);
    let newer = pod("newer", MINUTE * 5, Some(MINUTE * 2));
    let api2 = Api::new(&[good, newer]).await?;
    let trace = api2.dir.join("trace");
    std::fs::create_dir(&trace)?;
    let command = api2.agent_command(
        &dir,
        &[&format!("--allow-image-repository={PROXY_REPOSITORY}")],
    )?;
    let agent = ChildProcess::spawn(strace::traced(&command, &trace), "recover")?;
    wait_log(&agent, "checkpoint written").await?;
    stop_traced(&agent).await?;
    ensure!(checkpoint_of(&api.checkpoint()).as_deref() == Some("kube-system/newer"));
    let t = Trace::read(&trace)?;
    for file in [api.checkpoint(), dir.join("kube-apiserver.previous.json")] {
        t.ensure_written_durably(&file, 0o600)?;
        ensure!(
            mode(&file)? == 0o600,
            "{}: mode {:o}",
            file.display(),
            mode(&file)?
        );
    }

    // At boot, the checkpoint activated in the kubelet's directory.
    let node = AgentNode::new(&checkpoint("/etc/kubernetes/pki"))?;
    let trace = node.dir.join("trace");
    std::fs::create_dir(&trace)?;
    let agent = ChildProcess::spawn(strace::traced(&node.command(&[])?, &trace), "recover")?;
    node.decided(&agent).await?;
    ensure!(
        node.marker_text().starts_with("activated kube-system/good"),
        "marker: {}",
        node.marker_text()
    );
    stop_traced(&agent).await?;
    Trace::read(&trace)?.ensure_written_durably(&node.manifest(), 0o600)?;
    ensure!(mode(&node.manifest())? == 0o600);
    Ok(())
}

/// Stops `recover` run under strace (SIGTERM to it: strace keeps fatal signals from itself)
/// and waits until strace, and so its trace, is done.
async fn stop_traced(traced: &ChildProcess) -> Result<()> {
    let pid = strace::tracee(traced.pid())?;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGTERM,
    )?;
    let status = traced.wait_exit(DEADLINE).await?;
    ensure!(status.success(), "recover under strace: {status}");
    Ok(())
}

/// The agent's metrics address takes the TLS options of the proxy's scrape address: with a
/// certificate it speaks TLS and answers only scrapers presenting a client certificate of
/// `--metrics-client-ca-file`; plain HTTP and a client without a certificate get nothing; a
/// certificate without the other two flags is bad input (exit 2, one line).
#[tokio::test]
async fn recover_metrics_over_tls_answer_client_certificates_only() -> Result<()> {
    let pki = Pki::new()?;
    let dir = TempDir::new("recover-tls")?;
    let metrics = free_random_loopback_addr()?;
    let tls = pki.metrics_tls_flags();
    let mut command = Command::new(proxy_bin()?);
    command
        .arg("recover")
        .arg(format!("--node-address={}", free_random_loopback_addr()?))
        .arg(format!("--static-pod-dir={}", dir.path().display()))
        .arg("--boot-marker")
        .arg(dir.join("boot"))
        .arg(format!("--retire-file={}", dir.join("retire").display()))
        .arg(format!("--metrics-listen={metrics}"))
        .args(&tls)
        .env_remove("RUST_LOG");
    let agent = ChildProcess::spawn(command, "recover")?;
    let client = HttpsClient::new(pki.client_config(true)?);
    eventually(DEADLINE, || async {
        agent.ensure_running()?;
        let (code, body) = client.get(metrics, "/metrics").await?;
        ensure!(code == 200, "HTTP {code}");
        ensure!(
            body.contains("kube_apiserver_proxy_checkpoint"),
            "no checkpoint metric: {body}"
        );
        Ok(())
    })
    .await?;
    ensure_scrapes_refused(metrics, &pki, 3).await?;
    drop(agent);
    let out = run_cli([
        "recover".to_owned(),
        "--node-address=127.0.0.1:6443".to_owned(),
        format!("--static-pod-dir={}", dir.path().display()),
        format!("--metrics-listen={metrics}"),
        tls[0].clone(),
    ])
    .await?;
    let line = bad_input_line(&out, "a certificate alone")?;
    ensure!(line.contains("--metrics-tls-key-file"), "{line}");
    Ok(())
}
