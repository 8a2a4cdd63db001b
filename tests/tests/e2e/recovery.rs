//! Reboot recovery (docs/architecture.md, "Reboot recovery"): the node agent (`recover`) that
//! writes the checkpoint of the Deployment's pod that stayed ready (read over mTLS with the
//! node's kubeconfig), activates it at boot and removes it when asked; and the recovery
//! instance asking to be retired once a ready peer serves (`run --retire-file`). Real
//! processes, real files, real sockets, real TLS.

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::fake_apiserver::FakeApiserver;
use kube_apiserver_proxy_tests::process::ChildProcess;
use kube_apiserver_proxy_tests::proxy::{proxy_bin, run_cli, ProxyBuilder};
use kube_apiserver_proxy_tests::util::{eventually, free_random_loopback_addr, TempDir};
use serde_json::{json, Value};

use crate::{listen_addr, DEADLINE};

const PODS_PATH: &str = "/api/v1/namespaces/kube-system/pods";
const RETIRE: &str = "/run/kube-apiserver-proxy/checkpoint-retire";

fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// A pod of the Deployment as the API lists it, created `age` ago, Ready since `ready` ago
/// (never ready: `None`).
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
            "labels": {"component": "kube-apiserver", "tier": "control-plane", "pod-template-hash": "5c9d8"}},
        "spec": {
            "nodeName": "node-1", "hostNetwork": true,
            "containers": [
                {"name": "kube-apiserver", "image": "kube-apiserver:v1",
                 "args": [format!("--etcd-servers=https://127.0.0.1:2379/{name}")]},
                {"name": "proxy", "image": "proxy:v1", "command": ["/kube-apiserver-proxy", "run"],
                 "args": ["--handoff-dir=/run/kube-apiserver-proxy/handoff"]}
            ]
        },
        "status": {"phase": "Running", "conditions": conditions}
    })
}

/// A checkpoint directory, and an apiserver listing `pods` to the node's client certificate.
struct Api {
    pki: Pki,
    fake: FakeApiserver,
    dir: TempDir,
}

impl Api {
    async fn new(pods: &[Value]) -> Result<Self> {
        let pki = Pki::new()?;
        // Kubeconfigs name the apiserver by IP: the serving certificate has it.
        let ip = kube_apiserver_proxy_tests::util::random_loopback_ip()?;
        let serving = pki.ca.server_cert(&["kubernetes", &ip.to_string()])?;
        let fake = FakeApiserver::https_with_identity(serving.cert_chain(), serving.private_key())
            .bind(SocketAddr::new(ip, 0))
            .require_client_cert(pki.ca.root_store()?)
            .object(PODS_PATH, &json!({"kind": "PodList", "items": pods}))
            .start()
            .await?;
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
        Ok(Self { pki, fake, dir })
    }

    fn checkpoint_dir(&self) -> PathBuf {
        self.dir.join("checkpoint")
    }

    fn checkpoint(&self) -> PathBuf {
        self.checkpoint_dir().join("kube-apiserver.json")
    }

    /// The agent writing checkpoints into `dir` (reading from this apiserver).
    fn agent(&self, dir: &Path) -> Result<ChildProcess> {
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
            .args(["--interval=100ms", "--checkpoint-interval=200ms"])
            .arg("--checkpoint-after=60s")
            .env_remove("RUST_LOG");
        ChildProcess::spawn(command, "recover")
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
    ] {
        let out = run_cli(&args).await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(
            out.status.code() == Some(2),
            "{args:?}: {:?} {stderr}",
            out.status
        );
        ensure!(
            stderr.trim().lines().count() == 1 && stderr.contains(expect),
            "{args:?}: {stderr}"
        );
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

/// A checkpoint as the writer makes it (enough for `recover`'s checks).
fn checkpoint(host_path: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "kube-apiserver-checkpoint", "namespace": "kube-system",
            "annotations": {"kube-apiserver-proxy/checkpoint-of": "kube-system/good",
                "kube-apiserver-proxy/checkpoint-of-uid": "u",
                "kube-apiserver-proxy/checkpoint-of-created": "2025-01-01T00:00:00Z",
                "kube-apiserver-proxy/checkpointed-at": "2025-01-01T00:01:00Z"}},
        "spec": {"hostNetwork": true,
            "containers": [{"name": "kube-apiserver", "image": "kube-apiserver:v1"}],
            "volumes": [{"name": "pki", "hostPath": {"path": host_path}}]}})
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

    fn retire(&self) -> PathBuf {
        self.dir.join("retire")
    }

    /// Starts `recover` and waits until it made (or skipped) this boot's decision.
    async fn agent(&self) -> Result<ChildProcess> {
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
            .arg("--interval=100ms")
            .env_remove("RUST_LOG");
        let agent = ChildProcess::spawn(command, "recover")?;
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
        .await?;
        Ok(agent)
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
