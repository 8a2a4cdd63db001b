//! `kubeadm-sync`, the node agent of a migrated controller
//! (docs/runbooks/upgrade-kubernetes.md), against a fake apiserver over mTLS (admin.conf style
//! kubeconfig) that answers a Deployment `PUT` as the Deployment controller would, its
//! rollout completing a set time later:
//!
//! - `--once` (the migration): kubeadm's other manifests copied with the UIDs of the running
//!   pods (their mirror pods' `kubernetes.io/config.hash`); the Deployment, stale, replaced by
//!   the one rendered from kubeadm's manifest, the live proxy image kept; the stand-in
//!   `kube-apiserver` written only once the rollout completed; kubeadm's manifest set aside
//!   until the agent runs (then put back), or put back at once, and `--once` failed, while
//!   kubeadm's apiserver goes on running;
//! - running: a new kubeadm manifest (what `kubeadm upgrade apply` writes) becomes a `PUT`, and
//!   the stand-in, whose hash kubeadm waits on, changes only when the rollout is complete; an
//!   updated manifest of another component is copied with a UID of its content (the same
//!   content, the same UID, whatever the kubelet's version), a removed one's copy removed; a
//!   copy without a UID (an earlier release's) gets the running pod's; etcd's new image keeps
//!   the running pod's UID (the kubelet restarts etcd in its pod), and once the kubelet reports
//!   the new container running and ready, the mirror pod gets the image and a new config hash.
//!
//! And under `strace`: every static pod it writes at the migration (etcd's copy, the stand-in,
//! the list of its copies) is written durably, in kubeadm's mode 0600. And the static binary,
//! in an otherwise empty root, migrates through a `controlPlaneEndpoint` given as a name
//! (`/etc/hosts`).
//!
//! Needs python3 with PyYAML to read the YAML the agent writes, and strace; without them the
//! tests say they are skipped, except in CI, where they fail.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _, Result};
use kube_apiserver_proxy_tests::certs::Pki;
use kube_apiserver_proxy_tests::fake_apiserver::{FakeApiserver, FakeApiserverBuilder};
use kube_apiserver_proxy_tests::process::{bad_input_line, ChildProcess};
use kube_apiserver_proxy_tests::proxy::proxy_bin;
use kube_apiserver_proxy_tests::strace::{self, Trace};
use kube_apiserver_proxy_tests::util::{eventually, skip, TempDir};
use serde_json::{json, Value};

use crate::DEADLINE;

const DEPLOYMENT: &str = "/apis/apps/v1/namespaces/kube-system/deployments/kube-apiserver";
/// A `controlPlaneEndpoint` given as a name (also in the fake apiserver's certificate).
const CONTROL_PLANE_NAME: &str = "control-plane.cluster.test";
const ROLLOUT: Duration = Duration::from_millis(1500);
/// The stand-in's file in the kubelet's directory.
const APISERVER_STANDIN: &str = "kube-apiserver.yaml";

fn apiserver_manifest(version: &str, extra_flag: &str) -> String {
    format!(
        "apiVersion: v1
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
    - --secure-port=6443
    - --tls-cert-file=/etc/kubernetes/pki/apiserver.crt{extra_flag}
    image: registry.k8s.io/kube-apiserver:{version}
    imagePullPolicy: IfNotPresent
    name: kube-apiserver
    readinessProbe:
      httpGet: {{host: 192.0.2.10, path: /readyz, port: probe-port, scheme: HTTPS}}
      periodSeconds: 1
    resources:
      requests:
        cpu: 250m
  hostNetwork: true
  priorityClassName: system-node-critical
"
    )
}

fn other_manifest(name: &str, image: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata:\n  labels:\n    component: {name}\n    tier: control-plane\n  name: {name}\n  namespace: kube-system\nspec:\n  containers:\n  - name: {name}\n    image: {image}\n  hostNetwork: true\n"
    )
}

/// kubeadm's etcd manifest (the flags the canary reads and rewrites) with `image`, `member`
/// its client address (the fake etcd's), its CA in `pki`, and `extra` flags.
fn etcd_manifest(image: &str, member: std::net::SocketAddr, pki: &Path, extra: &str) -> String {
    format!(
        "apiVersion: v1
kind: Pod
metadata:
  annotations:
    kubeadm.kubernetes.io/etcd.advertise-client-urls: https://{member}
  labels:
    component: etcd
    tier: control-plane
  name: etcd
  namespace: kube-system
spec:
  containers:
  - command:
    - etcd
    - --advertise-client-urls=https://{member}
    - --data-dir=/var/lib/etcd
    - --listen-client-urls=https://127.0.0.1:2379
    - --listen-metrics-urls=http://127.0.0.1:2381
    - --listen-peer-urls=https://192.0.2.10:2380
    - --name=node-1
    - --trusted-ca-file={}/ca.crt{extra}
    image: {image}
    name: etcd
    volumeMounts:
    - {{mountPath: /var/lib/etcd, name: etcd-data}}
  hostNetwork: true
  volumes:
  - {{hostPath: {{path: /var/lib/etcd, type: DirectoryOrCreate}}, name: etcd-data}}
",
        pki.display()
    )
}

/// etcd's JSON gateway calls the canary makes.
const ETCD_STATUS: &str = "/v3/maintenance/status";
const ETCD_ADD: &str = "/v3/cluster/member/add";
const ETCD_LIST: &str = "/v3/cluster/member/list";
const ETCD_REMOVE: &str = "/v3/cluster/member/remove";

/// The canary's answer to Status: a learner that applied the log up to `applied` (the fake
/// member's index is 5).
fn canary_status(applied: u64) -> Value {
    json!({"version": "3.7.0", "isLearner": true, "raftIndex": "5", "raftAppliedIndex": applied.to_string()})
}

/// A YAML file as JSON (PyYAML).
fn read_yaml(path: &Path) -> Result<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, json, yaml\njson.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)",
        ])
        .arg(path)
        .output()?;
    ensure!(
        out.status.success(),
        "{}: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

fn digest(meta: &Value) -> Option<String> {
    meta["annotations"]["kube-apiserver-proxy/kubeadm-manifest-sha256"]
        .as_str()
        .map(str::to_owned)
}

struct Node {
    fake: FakeApiserver,
    /// etcd's running member (its JSON gateway) and the canary's learner, over mTLS with the
    /// `healthcheck-client` certificate beside etcd's CA in `dir/pki/etcd`.
    etcd: FakeApiserver,
    canary: FakeApiserver,
    dir: TempDir,
    pki: Pki,
}

/// kubeadm's admin.conf: the CA, the server, a client certificate and key in files.
fn write_admin_conf(
    path: &Path,
    pki: &Pki,
    server: std::net::SocketAddr,
    cert: &Path,
    key: &Path,
) -> Result<()> {
    std::fs::write(
        path,
        format!(
            "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority: {}\n    server: https://{}\n  name: c\nusers:\n- name: kubernetes-admin\n  user:\n    client-certificate: {}\n    client-key: {}\n",
            pki.ca_file().display(),
            server,
            cert.display(),
            key.display()
        ),
    )?;
    Ok(())
}

/// What an API request asks of RBAC: (namespace, API group, resource[/subresource], name, verb).
fn rbac_request(method: &str, path: &str) -> Option<(String, String, String, String, String)> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match parts.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return None,
    };
    let (ns, rest) = match rest {
        ["namespaces", ns, rest @ ..] if !rest.is_empty() => (*ns, rest),
        _ => ("", rest),
    };
    let (resource, name, sub) = match rest {
        [resource] => (*resource, "", None),
        [resource, name] => (*resource, *name, None),
        [resource, name, sub] => (*resource, *name, Some(*sub)),
        _ => return None,
    };
    let verb = match (method, name.is_empty()) {
        ("GET", true) => "list",
        ("GET", false) => "get",
        ("PUT", _) => "update",
        ("POST", _) => "create",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "deletecollection",
        ("DELETE", false) => "delete",
        _ => return None,
    };
    let resource = match sub {
        Some(sub) => format!("{resource}/{sub}"),
        None => resource.to_owned(),
    };
    Some((
        ns.to_owned(),
        group.to_owned(),
        resource,
        name.replace("%3A", ":"),
        verb.to_owned(),
    ))
}

/// Whether the rules (by namespace; "" for the ClusterRole's, which hold everywhere) allow
/// `method path`, as the RBAC authorizer decides.
fn rbac_allows(rules: &[(String, Vec<Value>)], method: &str, path: &str) -> bool {
    let Some((ns, group, resource, name, verb)) = rbac_request(method, path) else {
        return false;
    };
    let has = |list: &Value, item: &str| {
        list.as_array()
            .is_some_and(|l| l.iter().any(|v| v == item || v == "*"))
    };
    rules
        .iter()
        .filter(|(scope, _)| scope.is_empty() || *scope == ns)
        .flat_map(|(_, rules)| rules)
        .any(|r| {
            has(&r["apiGroups"], &group)
                && has(&r["resources"], &resource)
                && has(&r["verbs"], &verb)
                && (r.get("resourceNames").is_none() || has(&r["resourceNames"], &name))
        })
}

#[test]
fn the_rbac_evaluator_reads_paths_as_the_authorizer_does() {
    let rules = vec![
        (
            "kube-system".to_owned(),
            vec![
                json!({"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["kube-apiserver"], "verbs": ["get", "update"]}),
            ],
        ),
        (
            String::new(),
            vec![json!({"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]})],
        ),
    ];
    assert!(rbac_allows(&rules, "PUT", DEPLOYMENT));
    assert!(!rbac_allows(&rules, "DELETE", DEPLOYMENT));
    assert!(!rbac_allows(
        &rules,
        "GET",
        "/apis/apps/v1/namespaces/default/deployments/kube-apiserver"
    ));
    assert!(!rbac_allows(
        &rules,
        "GET",
        "/apis/apps/v1/namespaces/kube-system/deployments/other"
    ));
    assert!(rbac_allows(&rules, "GET", "/api/v1/nodes"));
    assert!(!rbac_allows(&rules, "GET", "/api/v1/nodes/node-1"));
    assert!(!rbac_allows(&rules, "GET", "/readyz"));
}

impl Node {
    /// Every call the agent made to the apiserver is one its own identity's RBAC
    /// (`kubeadm-sync --write-kubeconfig`, `identity::rules`) allows: an agent that
    /// starts calling something new fails here until its RBAC says so.
    fn ensure_calls_allowed(&self) -> Result<()> {
        use kube_apiserver_proxy::node::kubeadm::identity::{self, Identity};
        let manifests = self.dir.join("manifests");
        let id = Identity {
            node: "node-1",
            deployment: ("kube-system", "kube-apiserver"),
            kubeadm_dir: &manifests,
        };
        // The typed rules (k8s-openapi's PolicyRule) as JSON, as the evaluator reads them.
        let rules: Vec<(String, Vec<Value>)> = identity::rules(&id, &identity::leases(&manifests))
            .into_iter()
            .map(|(ns, rules)| {
                let rules = rules
                    .iter()
                    .map(|r| serde_json::to_value(r).expect("a rule serializes"))
                    .collect();
                (ns, rules)
            })
            .collect();
        let calls = self.fake.calls();
        let denied: Vec<String> = calls
            .iter()
            .filter(|(_, path)| path.starts_with("/api"))
            .filter(|(method, path)| !rbac_allows(&rules, method, path))
            .map(|(method, path)| format!("{method} {path}"))
            .collect();
        ensure!(
            calls.iter().any(|(_, p)| p.starts_with("/api")),
            "no API call recorded"
        );
        ensure!(
            denied.is_empty(),
            "calls the agent's RBAC does not allow: {denied:?}"
        );
        Ok(())
    }

    /// `kubeadm certs renew admin.conf`, and the old client certificate no longer accepted (as
    /// once it expired): admin.conf names a new certificate in new files.
    fn renew_admin_conf(&self) -> Result<()> {
        let renewed = self.pki.ca.client_cert("kubernetes-admin")?;
        let (cert, key) = renewed.write_pem(self.dir.path(), "admin-renewed")?;
        write_admin_conf(
            &self.dir.join("admin.conf"),
            &self.pki,
            self.fake.addr(),
            &cert,
            &key,
        )?;
        self.fake
            .revoke_client_cert(&self.pki.client.cert_chain()[0]);
        Ok(())
    }

    async fn new() -> Result<Self> {
        Self::with(|b| b).await
    }

    /// A node whose fake apiserver is made by `customize` from the usual one.
    async fn with(
        customize: impl FnOnce(FakeApiserverBuilder) -> FakeApiserverBuilder,
    ) -> Result<Self> {
        let pki = Pki::new()?;
        let ip = kube_apiserver_proxy_tests::util::random_loopback_ip()?;
        let serving = pki
            .ca
            .server_cert(&["kubernetes", CONTROL_PLANE_NAME, &ip.to_string()])?;
        // A Deployment applied from an earlier rendering: other digests, a live proxy image.
        let live = json!({"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "kube-apiserver", "namespace": "kube-system", "generation": 4,
                         "resourceVersion": "41", "labels": {"app.kubernetes.io/name": "kube-apiserver"}},
            "spec": {"replicas": 1, "template": {"metadata": {"annotations": {}},
                "spec": {"containers": [{"name": "kube-apiserver", "image": "old"},
                                        {"name": "proxy", "image": "registry.example/kap:live"}]}}},
            "status": {"observedGeneration": 4, "replicas": 1, "updatedReplicas": 1, "availableReplicas": 1}});
        let mirror =
            |hash: &str| json!({"metadata": {"annotations": {"kubernetes.io/config.hash": hash}}});
        let fake = FakeApiserver::https_with_identity(serving.cert_chain(), serving.private_key());
        let fake = customize(fake)
            .bind(std::net::SocketAddr::new(ip, 0))
            .require_client_cert(pki.ca.root_store()?)
            .object(DEPLOYMENT, &live)
            .object(
                "/api/v1/namespaces/kube-system/pods/etcd-node-1",
                &mirror("uid-etcd"),
            )
            .object(
                "/api/v1/namespaces/kube-system/pods/kube-scheduler-node-1",
                &mirror("uid-scheduler"),
            )
            .rollout_time(ROLLOUT)
            .start()
            .await?;
        let dir = TempDir::new("kubeadm-sync")?;
        std::fs::create_dir(dir.join("manifests"))?;
        let etcd_pki = dir.join("pki/etcd");
        std::fs::create_dir_all(&etcd_pki)?;
        std::fs::copy(pki.ca_file(), etcd_pki.join("ca.crt"))?;
        pki.ca
            .client_cert("kube-etcd-healthcheck-client")?
            .write_pem(&etcd_pki, "healthcheck-client")?;
        let etcd_ip = kube_apiserver_proxy_tests::util::random_loopback_ip()?;
        let etcd_serving = pki.ca.server_cert(&[&etcd_ip.to_string()])?;
        let etcd = FakeApiserver::https_with_identity(
            etcd_serving.cert_chain(),
            etcd_serving.private_key(),
        )
        .bind(std::net::SocketAddr::new(etcd_ip, 0))
        .require_client_cert(pki.ca.root_store()?)
        .start()
        .await?;
        let canary_serving = pki.ca.server_cert(&["127.0.0.1"])?;
        let canary = FakeApiserver::https_with_identity(
            canary_serving.cert_chain(),
            canary_serving.private_key(),
        )
        .bind("127.0.0.1:0".parse()?)
        .require_client_cert(pki.ca.root_store()?)
        .object(ETCD_STATUS, &canary_status(5))
        .start()
        .await?;
        let learner = json!({"ID": "42", "peerURLs": [format!("https://127.0.0.1:{}", canary.addr().port() + 1)], "isLearner": true});
        let member = json!({"ID": "7", "name": "node-1", "peerURLs": ["https://192.0.2.10:2380"]});
        etcd.set_object(ETCD_STATUS, &json!({"version": "3.6.8", "raftIndex": "5"}));
        etcd.set_object(
            ETCD_ADD,
            &json!({"member": learner, "members": [member, learner]}),
        );
        // The learner stays listed: each canary removes it before and after.
        etcd.set_object(ETCD_LIST, &json!({"members": [member, learner]}));
        etcd.set_object(ETCD_REMOVE, &json!({}));
        std::fs::write(
            dir.join("manifests/kube-apiserver.yaml"),
            apiserver_manifest("v1.36.3", ""),
        )?;
        std::fs::write(
            dir.join("manifests/etcd.yaml"),
            etcd_manifest("etcd:3.6.8-0", etcd.addr(), &etcd_pki, ""),
        )?;
        std::fs::write(
            dir.join("manifests/kube-scheduler.yaml"),
            other_manifest("kube-scheduler", "kube-scheduler:v1.36.3"),
        )?;
        write_admin_conf(
            &dir.join("admin.conf"),
            &pki,
            fake.addr(),
            &pki.client_cert_file(),
            &pki.client_key_file(),
        )?;
        Ok(Self {
            fake,
            etcd,
            canary,
            dir,
            pki,
        })
    }

    fn agent(&self, once: bool) -> Command {
        let mut c = Command::new(proxy_bin().expect("proxy binary"));
        c.arg("kubeadm-sync")
            .arg("--kubeadm-dir")
            .arg(self.dir.join("manifests"))
            .arg("--static-pod-dir")
            .arg(self.dir.join("kubelet"))
            .arg("--kubeconfig")
            .arg(self.dir.join("admin.conf"))
            .args([
                "--node-name=node-1",
                "--proxy-image=registry.example/kap:agent",
            ])
            .args([
                "--interval=100ms",
                "--settle=300ms",
                "--rollout-timeout=30s",
                "--etcd-canary-timeout=5s",
            ])
            .arg(format!("--etcd-canary-port={}", self.canary.addr().port()))
            .env_remove("RUST_LOG");
        if once {
            c.arg("--once");
        }
        c
    }

    /// kubeadm writes `name`'s manifest (etcd, kube-scheduler) with `image`; the agent's copy
    /// of it, once copied.
    async fn kubeadm_writes(&self, name: &str, image: &str) -> Result<Value> {
        let file = format!("{name}.yaml");
        let text = match name {
            "etcd" => self.etcd_manifest(image, ""),
            _ => other_manifest(name, image),
        };
        std::fs::write(self.dir.join("manifests").join(&file), text)?;
        eventually(DEADLINE, || async {
            let copy = read_yaml(&self.dir.join("kubelet").join(&file))?;
            ensure!(copy["spec"]["containers"][0]["image"] == image, "{copy}");
            Ok(copy)
        })
        .await
    }

    fn etcd_manifest(&self, image: &str, extra: &str) -> String {
        etcd_manifest(image, self.etcd.addr(), &self.dir.join("pki/etcd"), extra)
    }

    fn standin(&self) -> Result<Value> {
        read_yaml(&self.dir.join("kubelet/kube-apiserver.yaml"))
    }

    fn deployment(&self) -> Value {
        self.fake.object(DEPLOYMENT).expect("served")
    }
}

/// Whether python3 with PyYAML runs here ([`read_yaml`]).
fn pyyaml() -> bool {
    Command::new("python3")
        .args(["-c", "import yaml"])
        .status()
        .is_ok_and(|s| s.success())
}

/// Waits until the agent has said each of `said` and the canary's pod file is gone.
async fn canary_ended(agent: &ChildProcess, canary_file: &Path, said: &[&str]) -> Result<()> {
    eventually(DEADLINE, || async {
        for text in said {
            ensure!(
                agent.stderr().contains(text),
                "not said: {text}: {}",
                agent.stderr()
            );
        }
        ensure!(!canary_file.exists(), "the canary's pod left");
        Ok(())
    })
    .await
}

/// `--once`, the migration: returns when it succeeded.
async fn migrate(node: &Node) -> Result<()> {
    run_once(node.agent(true)).await
}

/// Runs `command`, an agent's `--once`, to its end: an error unless it succeeded.
async fn run_once(mut command: Command) -> Result<()> {
    let out = tokio::task::spawn_blocking(move || command.output()).await??;
    ensure!(
        out.status.success(),
        "--once failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// On a cluster of several control-plane nodes each controller's agent would replace the
/// Deployment with its own manifest in turn: refused, exit 2 with one line, the Deployment
/// left as it is.
#[tokio::test]
async fn kubeadm_sync_refuses_a_cluster_of_several_controllers() -> Result<()> {
    let nodes = json!({"apiVersion": "v1", "kind": "NodeList", "items": [
        {"metadata": {"name": "node-1", "labels": {"node-role.kubernetes.io/control-plane": ""}}},
        {"metadata": {"name": "node-2", "labels": {"node-role.kubernetes.io/control-plane": ""}}}]});
    let node = Node::with(|b| b.object("/api/v1/nodes", &nodes)).await?;
    let before = node.deployment();
    let out = tokio::task::spawn_blocking({
        let mut c = node.agent(true);
        move || c.output()
    })
    .await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2),
        "--once on two controllers: {}: {stderr}",
        out.status
    );
    ensure!(
        stderr.contains("2 control-plane nodes (node-1, node-2)"),
        "{stderr}"
    );
    ensure!(
        node.deployment() == before,
        "the Deployment was replaced on a cluster of two controllers"
    );
    Ok(())
}

/// A `kubeadm upgrade apply` whose new apiserver never gets ready fails safe, in step with
/// kubeadm (docs/runbooks/upgrade-kubernetes.md, "If the upgrade fails"): the agent replaces
/// the Deployment and does not wait on it, so the other static pods are still copied; the
/// stand-in, whose hash kubeadm waits on, stays as it was; when the Deployment reports
/// `ProgressDeadlineExceeded` the agent says the rollout failed; kubeadm, its wait failed, puts
/// its old manifest back, and the agent rolls the Deployment back to it (the same stand-in, the
/// same UID: nothing restarts). A following good upgrade goes through.
#[tokio::test]
async fn kubeadm_sync_rolls_back_with_kubeadm_when_the_new_apiserver_never_gets_ready() -> Result<()>
{
    if !pyyaml() {
        return skip(
            "kubeadm_sync_rolls_back_with_kubeadm_when_the_new_apiserver_never_gets_ready",
            "python3 with PyYAML needed (pip install kubernetes-validate brings it)",
        );
    }
    let node = Node::with(|b| b.never_ready_with("--never-ready", Duration::from_secs(3))).await?;
    migrate(&node).await?;
    let before = node.standin()?;
    let agent = ChildProcess::spawn(node.agent(false), "kubeadm-sync")?;
    let manifest = node.dir.join("manifests/kube-apiserver.yaml");
    let old_manifest = eventually(DEADLINE, || async {
        std::fs::read(&manifest).context("kubeadm's manifest not put back")
    })
    .await?;
    let old_template = node.deployment()["spec"]["template"].clone();

    // kubeadm upgrade apply writes a manifest whose apiserver never gets ready.
    std::fs::write(
        &manifest,
        apiserver_manifest("v1.37.2", "\n    - --never-ready"),
    )?;
    eventually(DEADLINE, || async {
        agent.ensure_running()?;
        ensure!(
            node.deployment()["spec"]["template"]
                .to_string()
                .contains("--never-ready"),
            "no PUT yet: {}",
            agent.stderr()
        );
        Ok(())
    })
    .await?;
    // While it hangs, another component's new manifest is still copied.
    node.kubeadm_writes("etcd", "etcd:3.7.0-0")
        .await
        .with_context(|| {
            format!(
                "etcd not copied while the apiserver's rollout hangs: {}",
                agent.stderr()
            )
        })?;
    eventually(DEADLINE, || async {
        ensure!(
            agent.stderr().contains("ProgressDeadlineExceeded"),
            "the failed rollout not reported: {}",
            agent.stderr()
        );
        Ok(())
    })
    .await?;
    ensure!(
        node.standin()? == before,
        "the stand-in changed for a rollout that never completed"
    );

    // kubeadm's wait fails: it puts its old manifest back.
    std::fs::write(&manifest, &old_manifest)?;
    eventually(DEADLINE, || async {
        let d = node.deployment();
        ensure!(
            d["spec"]["template"] == old_template,
            "the Deployment is not back on the old template: {}",
            agent.stderr()
        );
        ensure!(
            d["status"]["replicas"] == 1 && d["status"]["updatedReplicas"] == 1,
            "the rollback's rollout not complete (a surge pod left): {}",
            d["status"]
        );
        Ok(())
    })
    .await?;
    ensure!(
        agent.stderr().contains("replacing it (rollback)"),
        "{}",
        agent.stderr()
    );
    ensure!(
        node.standin()? == before,
        "the stand-in changed by the rollback"
    );

    // The next upgrade, a good one, goes through, after kubeadm renewed admin.conf and the
    // old client certificate is no longer accepted: the agent reads its kubeadm's kubeconfig
    // again on every pass.
    node.renew_admin_conf()?;
    std::fs::write(&manifest, apiserver_manifest("v1.37.2", ""))?;
    eventually(DEADLINE, || async {
        let s = node.standin()?;
        ensure!(
            s["spec"]["containers"][0]["image"] == "registry.k8s.io/kube-apiserver:v1.37.2",
            "stand-in not rewritten: {}",
            agent.stderr()
        );
        ensure!(digest(&s["metadata"]) != digest(&before["metadata"]));
        Ok(())
    })
    .await?;
    agent.ensure_running()?;
    Ok(())
}

#[tokio::test]
async fn kubeadm_sync_turns_kubeadm_manifests_into_static_pods_and_rollouts() -> Result<()> {
    if !pyyaml() {
        return skip(
            "kubeadm_sync_turns_kubeadm_manifests_into_static_pods_and_rollouts",
            "python3 with PyYAML needed (pip install kubernetes-validate brings it)",
        );
    }
    let node = Node::new().await?;

    // --once, the migration.
    let started = Instant::now();
    migrate(&node).await?;
    ensure!(
        started.elapsed() >= ROLLOUT,
        "--once returned after {:?}, before the rollout completed",
        started.elapsed()
    );
    // kubeadm's manifest set aside (the kubelet, still on kubeadm's directory, stops kubeadm's
    // apiserver), until the agent runs.
    ensure!(
        node.dir.join("manifests/.kube-apiserver.yaml").exists()
            && !node.dir.join("manifests/kube-apiserver.yaml").exists(),
        "kubeadm's manifest not set aside"
    );
    let etcd = read_yaml(&node.dir.join("kubelet/etcd.yaml"))?;
    ensure!(
        etcd["metadata"]["uid"] == "uid-etcd",
        "etcd copy not adopted: {etcd}"
    );
    ensure!(etcd["spec"]["containers"][0]["image"] == "etcd:3.6.8-0");
    let sched = read_yaml(&node.dir.join("kubelet/kube-scheduler.yaml"))?;
    ensure!(sched["metadata"]["uid"] == "uid-scheduler", "{sched}");
    let d = node.deployment();
    let template = &d["spec"]["template"];
    let apiserver = &template["spec"]["containers"]
        .as_array()
        .context("containers")?
        .iter()
        .find(|c| c["name"] == "kube-apiserver")
        .context("no apiserver container")?
        .clone();
    ensure!(
        apiserver["image"] == "registry.k8s.io/kube-apiserver:v1.36.3",
        "{apiserver}"
    );
    ensure!(
        template["spec"]["containers"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| c["image"] == "registry.example/kap:live")),
        "the live proxy image was not kept"
    );
    ensure!(
        d["metadata"]["resourceVersion"] == "41",
        "not a replace of the live object"
    );
    let s = node.standin()?;
    ensure!(
        s["metadata"]["name"] == "kube-apiserver"
            && s["metadata"]["labels"]["component"] == "kube-apiserver"
    );
    ensure!(s["spec"]["containers"][0]["image"] == "registry.k8s.io/kube-apiserver:v1.36.3");
    ensure!(s["spec"]["initContainers"][0]["image"] == "registry.example/kap:agent");
    ensure!(
        digest(&s["metadata"]) == digest(&template["metadata"]) && digest(&s["metadata"]).is_some()
    );

    let standin_uid = s["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
    ensure!(
        standin_uid.len() == 32,
        "the stand-in has no UID of its own: {s}"
    );

    // A copy an earlier release of the agent wrote, without a UID: it gets the running pod's
    // (nothing restarts), not one of its own.
    std::fs::write(
        node.dir.join("kubelet/kube-scheduler.yaml"),
        other_manifest("kube-scheduler", "kube-scheduler:v1.36.3"),
    )?;

    // Running: kubeadm upgrade writes a new apiserver manifest.
    let agent = ChildProcess::spawn(node.agent(false), "kubeadm-sync")?;
    eventually(DEADLINE, || async {
        ensure!(
            node.dir.join("manifests/kube-apiserver.yaml").exists(),
            "kubeadm's manifest not put back: {}",
            agent.stderr()
        );
        let sched = read_yaml(&node.dir.join("kubelet/kube-scheduler.yaml"))?;
        ensure!(sched["metadata"]["uid"] == "uid-scheduler", "{sched}");
        Ok(())
    })
    .await?;
    let old = digest(&s["metadata"]);
    std::fs::write(
        node.dir.join("manifests/kube-apiserver.yaml"),
        apiserver_manifest(
            "v1.37.2",
            "\n    - --audit-log-path=/var/log/kubernetes/audit.log",
        ),
    )?;
    let put_at = eventually(DEADLINE, || async {
        agent.ensure_running()?;
        let d = node.deployment();
        ensure!(
            d["spec"]["template"]["spec"]["containers"]
                .to_string()
                .contains("v1.37.2"),
            "no PUT yet: {}",
            agent.stderr()
        );
        Ok(Instant::now())
    })
    .await?;
    // While the rollout runs, the stand-in (whose hash kubeadm waits on) stays as it was.
    while put_at.elapsed() < ROLLOUT.mul_f32(0.8) {
        ensure!(
            digest(&node.standin()?["metadata"]) == old,
            "stand-in changed before the rollout completed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eventually(DEADLINE, || async {
        let s = node.standin()?;
        ensure!(
            digest(&s["metadata"]) != old,
            "stand-in not rewritten: {}",
            agent.stderr()
        );
        ensure!(s["spec"]["containers"][0]["image"] == "registry.k8s.io/kube-apiserver:v1.37.2");
        Ok(())
    })
    .await?;
    ensure!(
        node.deployment()["spec"]["template"]["spec"]["containers"]
            .to_string()
            .contains("--audit-log-path=/var/log/kubernetes/audit.log"),
        "the new flag did not reach the Deployment"
    );

    // The stand-in, rewritten for the new manifest, is a new pod (kubeadm waits for its hash).
    let s = node.standin()?;
    ensure!(
        s["metadata"]["uid"]
            .as_str()
            .is_some_and(|u| u.len() == 32 && u != standin_uid),
        "the new stand-in's UID: {s}"
    );

    // Another component's new manifest is copied with a UID of its content (a new pod for the
    // kubelet, and the same one for a kubelet of any version); a removed one's copy goes.
    let scheduler_uid = |image: &'static str| {
        let node = &node;
        async move {
            let copy = node.kubeadm_writes("kube-scheduler", image).await?;
            let uid = copy["metadata"]["uid"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            ensure!(uid.len() == 32 && uid != "uid-scheduler", "{copy}");
            Ok(uid)
        }
    };
    let newer = scheduler_uid("kube-scheduler:v1.37.2").await?;
    let back = scheduler_uid("kube-scheduler:v1.36.3").await?;
    ensure!(back != newer, "two contents, one UID: {back}");
    ensure!(
        scheduler_uid("kube-scheduler:v1.37.2").await? == newer,
        "the same content got another UID"
    );
    std::fs::remove_file(node.dir.join("manifests/kube-scheduler.yaml"))?;
    eventually(DEADLINE, || async {
        ensure!(
            !node.dir.join("kubelet/kube-scheduler.yaml").exists(),
            "scheduler copy left"
        );
        Ok(())
    })
    .await?;

    // etcd's new image (kubeadm's upgrade of etcd): the copy keeps the running pod's UID, so
    // the kubelet restarts etcd in its pod; once the kubelet reports the new container running
    // and ready, the agent sets the mirror pod's image and a new config hash (what kubeadm
    // waits on), and keeps its mirror annotation.
    const ETCD_MIRROR: &str = "/api/v1/namespaces/kube-system/pods/etcd-node-1";
    let etcd_mirror = |image: &str, running: &str| {
        json!({"metadata": {"name": "etcd-node-1", "namespace": "kube-system",
                "annotations": {"kubernetes.io/config.hash": "uid-etcd", "kubernetes.io/config.mirror": "uid-etcd"}},
            "spec": {"containers": [{"name": "etcd", "image": image}]},
            "status": {"containerStatuses": [{"name": "etcd", "image": running, "ready": true,
                "state": {"running": {"startedAt": "2026-12-05T00:00:00Z"}}}]}})
    };
    node.fake
        .set_object(ETCD_MIRROR, &etcd_mirror("etcd:3.6.8-0", "etcd:3.6.8-0"));
    let etcd = node.kubeadm_writes("etcd", "etcd:3.7.0-0").await?;
    ensure!(
        etcd["metadata"]["uid"] == "uid-etcd",
        "etcd's UID not kept: {etcd}"
    );
    // Its canary ran first: a learner added, asked, removed, its pod file gone.
    ensure!(
        node.etcd.requests(ETCD_ADD) == 1
            && node.etcd.requests(ETCD_REMOVE) >= 1
            && node.canary.requests(ETCD_STATUS) >= 1,
        "etcd's copy changed without its canary: member add {}, remove {}, canary asked {}: {}",
        node.etcd.requests(ETCD_ADD),
        node.etcd.requests(ETCD_REMOVE),
        node.canary.requests(ETCD_STATUS),
        agent.stderr()
    );
    ensure!(
        !node.dir.join("kubelet/etcd-canary.yaml").exists(),
        "the canary's pod left"
    );
    // Stopped with a short grace period (kubeadm's pod sets none: 30 s), the agent's.
    ensure!(
        etcd["spec"]["terminationGracePeriodSeconds"] == 2
            && etcd["metadata"]["annotations"]["kube-apiserver-proxy/restart-grace"] == "2",
        "etcd's copy restarts without the short grace period: {etcd}"
    );
    // The old container still runs: the mirror pod is left as it is.
    let m = node.fake.object(ETCD_MIRROR).context("etcd's mirror pod")?;
    ensure!(
        m["metadata"]["annotations"]["kubernetes.io/config.hash"] == "uid-etcd",
        "the mirror pod changed before the new etcd ran: {m}"
    );
    node.fake
        .set_object(ETCD_MIRROR, &etcd_mirror("etcd:3.6.8-0", "etcd:3.7.0-0"));
    eventually(DEADLINE, || async {
        let m = node.fake.object(ETCD_MIRROR).context("etcd's mirror pod")?;
        let a = &m["metadata"]["annotations"];
        ensure!(
            a["kubernetes.io/config.hash"]
                .as_str()
                .is_some_and(|h| h.len() == 32 && h != "uid-etcd"),
            "config hash: {m}"
        );
        ensure!(a["kubernetes.io/config.mirror"] == "uid-etcd", "{m}");
        ensure!(m["spec"]["containers"][0]["image"] == "etcd:3.7.0-0", "{m}");
        Ok(())
    })
    .await?;
    // The new etcd serves: the copy is kubeadm's pod again (with its UID), its grace period too.
    eventually(DEADLINE, || async {
        let etcd = read_yaml(&node.dir.join("kubelet/etcd.yaml"))?;
        ensure!(
            etcd["spec"].get("terminationGracePeriodSeconds").is_none()
                && etcd["metadata"]["annotations"]
                    .get("kube-apiserver-proxy/restart-grace")
                    .is_none()
                && etcd["metadata"]["uid"] == "uid-etcd"
                && etcd["spec"]["containers"][0]["image"] == "etcd:3.7.0-0",
            "etcd's copy keeps the restart's grace period: {etcd}"
        );
        Ok(())
    })
    .await?;

    // A new etcd that cannot start (a flag it rejects): its canary stops at once, as the
    // kubelet reports it, so etcd's copy is left as it runs (kubeadm's wait then fails and it
    // puts its manifest back); the canary is removed, and not run again for the same content.
    node.canary.set_object(ETCD_STATUS, &canary_status(0));
    let removed = node.etcd.requests(ETCD_REMOVE);
    std::fs::write(
        node.dir.join("manifests/etcd.yaml"),
        node.etcd_manifest("etcd:3.7.1-0", "\n    - --kap-rejected=1"),
    )?;
    let canary_file = node.dir.join("kubelet/etcd-canary.yaml");
    let canary = eventually(DEADLINE, || async {
        read_yaml(&canary_file).with_context(|| format!("no canary: {}", agent.stderr()))
    })
    .await?;
    let args = canary["spec"]["containers"][0]["command"].to_string();
    ensure!(
        canary["spec"]["containers"][0]["image"] == "etcd:3.7.1-0"
            && args.contains("--kap-rejected=1")
            && args.contains(&format!(
                "--listen-client-urls=https://127.0.0.1:{}",
                node.canary.addr().port()
            )),
        "the canary is not kubeadm's new pod on its own port: {canary}"
    );
    let uid = canary["metadata"]["uid"]
        .as_str()
        .context("the canary's UID")?;
    node.fake.set_object(
        "/api/v1/namespaces/kube-system/pods/etcd-canary-node-1",
        &json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": uid}},
            "status": {"phase": "Failed", "containerStatuses": [{"name": "etcd",
                "state": {"terminated": {"exitCode": 2, "reason": "Error",
                    "message": "flag provided but not defined: -kap-rejected"}}}]}}),
    );
    canary_ended(
        &agent,
        &canary_file,
        &[
            "the new etcd stopped: exit code 2, Error: flag provided but not defined: -kap-rejected",
            // The next pass refuses it without running the canary again.
            "kubeadm's etcd manifest still not copied",
        ],
    )
    .await?;
    ensure!(
        node.etcd.requests(ETCD_REMOVE) > removed && node.etcd.requests(ETCD_ADD) == 2,
        "the learner not removed, or the canary run again: remove {} -> {}, add {}",
        removed,
        node.etcd.requests(ETCD_REMOVE),
        node.etcd.requests(ETCD_ADD)
    );
    let etcd = read_yaml(&node.dir.join("kubelet/etcd.yaml"))?;
    ensure!(
        etcd["spec"]["containers"][0]["image"] == "etcd:3.7.0-0"
            && etcd["metadata"]["uid"] == "uid-etcd"
            && !etcd.to_string().contains("kap-rejected"),
        "etcd's copy changed after its canary failed: {etcd}"
    );

    // A canary that neither serves nor is reported stopped (a pod the kubelet did not admit
    // has no mirror pod): failed at its timeout, the copy left as it is.
    std::fs::write(
        node.dir.join("manifests/etcd.yaml"),
        node.etcd_manifest("etcd:3.7.2-0", ""),
    )?;
    canary_ended(
        &agent,
        &canary_file,
        &["the new etcd did not serve within 5s: applied index Some(0), the cluster's was 5"],
    )
    .await?;
    ensure!(
        read_yaml(&node.dir.join("kubelet/etcd.yaml"))?["spec"]["containers"][0]["image"]
            == "etcd:3.7.0-0",
        "etcd's copy changed after its canary timed out"
    );
    agent.ensure_running()?;
    node.ensure_calls_allowed()
}

/// `--once` while kubeadm's static apiserver does not stop (the kubelet down, or running
/// another directory): restarting the kubelet then would kill it as an orphan, cutting its
/// requests. Past `--once-timeout` the agent puts kubeadm's manifest back (the node as before)
/// and fails, exit 1, naming the process and saying not to restart the kubelet; once that
/// apiserver is gone, `--once` again succeeds.
#[tokio::test]
async fn kubeadm_sync_once_puts_the_manifest_back_and_fails_while_kubeadms_apiserver_runs(
) -> Result<()> {
    let node = Node::new().await?;
    // A process that looks like kubeadm's apiserver: named kube-apiserver, not bound to a
    // 127. address (a Deployment's is). It only sleeps.
    let mut sleeper = Command::new("sleep");
    sleeper.arg0("kube-apiserver").arg("600");
    let apiserver = ChildProcess::spawn(sleeper, "kube-apiserver")?;
    let mut once = node.agent(true);
    once.arg("--once-timeout=2s");
    let out = tokio::task::spawn_blocking(move || once.output()).await??;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(1),
        "--once: {}: {stderr}",
        out.status
    );
    let said = format!(
        "kubeadm's static apiserver (pid {}) still runs 2s after its manifest was set aside",
        apiserver.pid()
    );
    ensure!(
        stderr.contains(&said) && stderr.contains("do not restart the kubelet"),
        "{stderr}"
    );
    ensure!(
        node.dir.join("manifests/kube-apiserver.yaml").exists()
            && !node.dir.join("manifests/.kube-apiserver.yaml").exists(),
        "kubeadm's manifest not put back: {stderr}"
    );

    drop(apiserver);
    migrate(&node).await?;
    ensure!(
        node.dir.join("manifests/.kube-apiserver.yaml").exists()
            && !node.dir.join("manifests/kube-apiserver.yaml").exists(),
        "kubeadm's manifest not set aside by the second --once"
    );
    Ok(())
}

/// kubeadm's apiserver is looked for in the node's network namespace only (it is on the host
/// network): a kube-apiserver of another namespace (a nested test node, another cluster on the
/// machine) does not hold `--once` back.
#[tokio::test]
async fn kubeadm_sync_once_ignores_an_apiserver_of_another_network_namespace() -> Result<()> {
    let name = "kubeadm_sync_once_ignores_an_apiserver_of_another_network_namespace";
    if !kube_apiserver_proxy_tests::util::is_root() {
        return skip(name, "unshare --net needs root");
    }
    let node = Node::new().await?;
    let mut other = Command::new("unshare");
    other.args([
        "--net",
        "--",
        "bash",
        "-c",
        "exec -a kube-apiserver sleep 600",
    ]);
    let other = ChildProcess::spawn(other, "kube-apiserver")?;
    eventually(DEADLINE, || async {
        let cmdline = std::fs::read(format!("/proc/{}/cmdline", other.pid()))?;
        ensure!(
            cmdline.starts_with(b"kube-apiserver\0"),
            "not named yet: {cmdline:?}"
        );
        Ok(())
    })
    .await?;
    let mut once = node.agent(true);
    once.arg("--once-timeout=2s");
    run_once(once).await?;
    other.ensure_running()?;
    Ok(())
}

/// The migration's `--once` by the static binary, in a root holding nothing but it, kubeadm's
/// files at kubeadm's paths (the agent's defaults) and `/etc/hosts`, with an `admin.conf` whose
/// server is a `controlPlaneEndpoint` given as a name: the static glibc resolves it from
/// `/etc/hosts` (without `/etc/nsswitch.conf`; the DNS servers of `/etc/resolv.conf` are the
/// next source), and the agent replaces the Deployment and writes its stand-in through it.
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
#[tokio::test]
async fn kubeadm_sync_once_by_the_static_binary_reaches_the_control_plane_endpoint_by_name(
) -> Result<()> {
    let name = "kubeadm_sync_once_by_the_static_binary_reaches_the_control_plane_endpoint_by_name";
    if !kube_apiserver_proxy_tests::util::is_root() {
        return skip(name, "chroot needs root");
    }
    let node = Node::new().await?;
    let bin = crate::static_binary::static_bin()?;
    let root = TempDir::new("kubeadm-sync-root")?;
    let logs = TempDir::new("kubeadm-sync-root-logs")?;
    std::fs::copy(&bin, root.join("kube-apiserver-proxy"))?;
    let etc = root.join("etc");
    std::fs::create_dir_all(etc.join("kubernetes/manifests"))?;
    std::fs::create_dir_all(etc.join("kubernetes/pki"))?;
    for manifest in ["kube-apiserver.yaml", "etcd.yaml", "kube-scheduler.yaml"] {
        std::fs::copy(
            node.dir.join("manifests").join(manifest),
            etc.join("kubernetes/manifests").join(manifest),
        )?;
    }
    for (from, to) in [
        (node.pki.ca_file(), "ca.crt"),
        (node.pki.client_cert_file(), "admin.crt"),
        (node.pki.client_key_file(), "admin.key"),
    ] {
        std::fs::copy(from, etc.join("kubernetes/pki").join(to))?;
    }
    std::fs::write(
        etc.join("kubernetes/admin.conf"),
        format!(
            "apiVersion: v1\nclusters:\n- cluster:\n    certificate-authority: /etc/kubernetes/pki/ca.crt\n    server: https://{CONTROL_PLANE_NAME}:{}\n  name: c\nusers:\n- name: kubernetes-admin\n  user:\n    client-certificate: /etc/kubernetes/pki/admin.crt\n    client-key: /etc/kubernetes/pki/admin.key\n",
            node.fake.addr().port()
        ),
    )?;
    std::fs::write(
        etc.join("hosts"),
        format!(
            "127.0.0.1 localhost\n{} {CONTROL_PLANE_NAME}\n",
            node.fake.addr().ip()
        ),
    )?;

    let args: Vec<String> = [
        "/kube-apiserver-proxy",
        "kubeadm-sync",
        "--once",
        // kubeadm's own, naming the server by name (the agent's own identity is written by
        // --write-kubeconfig: kubeadm_sync_writes_its_own_kubeconfig_with_a_service_account_token).
        "--kubeconfig=/etc/kubernetes/admin.conf",
        "--node-name=node-1",
        "--proxy-image=registry.example/kap:agent",
        "--interval=100ms",
        "--settle=300ms",
        "--rollout-timeout=30s",
    ]
    .map(String::from)
    .to_vec();
    let mut once = crate::static_binary::Chrooted::spawn(root.path(), &logs, "once", &args)?;
    let status = once.wait_exit(DEADLINE).await?;
    ensure!(status.success(), "--once: {status}:\n{}", once.log());
    let d = node.deployment();
    ensure!(
        d["spec"]["template"]["spec"]["containers"]
            .to_string()
            .contains("registry.k8s.io/kube-apiserver:v1.36.3"),
        "the Deployment was not replaced: {}",
        once.log()
    );
    ensure!(
        etc.join("kubernetes/kubelet-manifests")
            .join(APISERVER_STANDIN)
            .is_file()
            && etc
                .join("kubernetes/manifests/.kube-apiserver.yaml")
                .is_file(),
        "no stand-in, or kubeadm's manifest not set aside: {}",
        once.log()
    );
    Ok(())
}

/// A power loss after `--once` leaves every static pod the kubelet is to run whole: each is a
/// temporary file created 0600 (kubeadm's mode), written and fsynced, renamed into place, and
/// then the directory fsynced (seen with strace).
#[tokio::test]
async fn kubeadm_sync_writes_the_static_pods_durably_in_kubeadms_mode() -> Result<()> {
    if let Err(reason) = strace::usable() {
        return skip(
            "kubeadm_sync_writes_the_static_pods_durably_in_kubeadms_mode",
            &reason,
        );
    }
    let node = Node::new().await?;
    let trace = node.dir.join("trace");
    std::fs::create_dir(&trace)?;
    run_once(strace::traced(&node.agent(true), &trace)).await?;
    let t = Trace::read(&trace)?;
    for name in [
        "etcd.yaml",
        "kube-scheduler.yaml",
        APISERVER_STANDIN,
        ".kubeadm-sync",
    ] {
        let path = node.dir.join("kubelet").join(name);
        t.ensure_written_durably(&path, 0o600)?;
        let mode = std::fs::metadata(&path)?.permissions().mode() & 0o7777;
        ensure!(mode == 0o600, "{name}: mode {mode:o}");
    }
    Ok(())
}

/// Going back (docs/runbooks/going-back.md): after the migration the kubelet runs the copies
/// (each with its UID) and the stand-in. `--undo` refuses while the stand-in is there (exit 2,
/// one line, kubeadm's files untouched); once kubeadm's apiserver runs from the kubelet's
/// directory in its place (what `migrate-back` installs: kubeadm's manifest with
/// `--permit-port-sharing=true` and a UID), it writes each pod the kubelet runs into kubeadm's
/// directory as it runs, with its UID: durably, in kubeadm's mode. It needs neither the API nor
/// `--node-name`/`--proxy-image`.
#[tokio::test]
async fn kubeadm_sync_undo_hands_kubeadm_the_pods_the_kubelet_runs_with_their_uids() -> Result<()> {
    if let Err(reason) = strace::usable() {
        return skip(
            "kubeadm_sync_undo_hands_kubeadm_the_pods_the_kubelet_runs_with_their_uids",
            &reason,
        );
    }
    let node = Node::new().await?;
    migrate(&node).await?;
    let (kubeadm, kubelet) = (node.dir.join("manifests"), node.dir.join("kubelet"));
    let bin = proxy_bin()?;
    let undo = || {
        let mut c = Command::new(&bin);
        c.args(["kubeadm-sync", "--undo", "--kubeadm-dir"])
            .arg(&kubeadm)
            .arg("--static-pod-dir")
            .arg(&kubelet);
        c
    };
    let before = std::fs::read(kubeadm.join("etcd.yaml"))?;
    let out = undo().output()?;
    let line = bad_input_line(&out, "--undo with the stand-in in the kubelet's directory")?;
    ensure!(
        line.contains("stand-in still runs") && line.contains("nothing written"),
        "{line}"
    );
    ensure!(
        std::fs::read(kubeadm.join("etcd.yaml"))? == before,
        "etcd.yaml written by a refusal"
    );

    // The agent, once it ran, put kubeadm's manifest back; migrate-back's is in the stand-in's
    // place.
    if kubeadm.join(".kube-apiserver.yaml").exists() {
        std::fs::rename(
            kubeadm.join(".kube-apiserver.yaml"),
            kubeadm.join("kube-apiserver.yaml"),
        )?;
    }
    let back = apiserver_manifest("v1.37.2", "--permit-port-sharing=true").replacen(
        "metadata:\n",
        "metadata:\n  uid: 6d6967726174652d6261636b00000001\n",
        1,
    );
    std::fs::write(kubelet.join(APISERVER_STANDIN), &back)?;
    let trace = node.dir.join("trace-undo");
    std::fs::create_dir(&trace)?;
    let out = strace::traced(&undo(), &trace).output()?;
    ensure!(
        out.status.success(),
        "--undo: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let t = Trace::read(&trace)?;
    for name in ["etcd.yaml", "kube-scheduler.yaml", "kube-apiserver.yaml"] {
        let path = kubeadm.join(name);
        let runs = std::fs::read(kubelet.join(name))?;
        ensure!(
            std::fs::read(&path)? == runs,
            "{name}: not what the kubelet runs"
        );
        let uid = read_yaml(&path)?["metadata"]["uid"].clone();
        ensure!(
            uid.as_str().is_some_and(|u| !u.is_empty()),
            "{name}: uid {uid}"
        );
        t.ensure_written_durably(&path, 0o600)?;
        let mode = std::fs::metadata(&path)?.permissions().mode() & 0o7777;
        ensure!(mode == 0o600, "{name}: mode {mode:o}");
    }
    Ok(())
}

/// kubeadm replaces the scheduler's pod (an upgrade): the agent removes the copy first, and only
/// once the kubelet has stopped the old pod (its mirror pod deleted) releases the lease the old
/// process still holds, as client-go releases its own (no holder, 1 s, the resourceVersion
/// read), then writes the new copy: the new scheduler leads at once instead of waiting out the
/// lease. While the old mirror pod is there, the lease stays its holder's and no copy is written.
#[tokio::test]
async fn kubeadm_sync_stops_a_controller_before_its_successor_and_hands_its_lease_over(
) -> Result<()> {
    const MIRROR: &str = "/api/v1/namespaces/kube-system/pods/kube-scheduler-node-1";
    const LEASE: &str = "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/kube-scheduler";
    let node = Node::new().await?;
    migrate(&node).await?;
    let annotations = json!({"kubernetes.io/config.hash": "uid-scheduler", "kubernetes.io/config.mirror": "uid-scheduler"});
    node.fake
        .set_object(MIRROR, &json!({"metadata": {"annotations": annotations}}));
    node.fake.set_object(
        LEASE,
        &json!({"metadata": {"name": "kube-scheduler", "namespace": "kube-system", "resourceVersion": "9"},
                "spec": {"holderIdentity": "node-1_4f1d", "leaseDurationSeconds": 15, "leaseTransitions": 2}}),
    );
    let agent = ChildProcess::spawn(node.agent(false), "kubeadm-sync")?;
    let copy = node.dir.join("kubelet/kube-scheduler.yaml");
    ensure!(copy.exists(), "no copy after the migration");
    std::fs::write(
        node.dir.join("manifests/kube-scheduler.yaml"),
        other_manifest("kube-scheduler", "kube-scheduler:v1.37.2"),
    )?;
    eventually(DEADLINE, || async {
        ensure!(!copy.exists(), "the old copy is still there");
        Ok(())
    })
    .await?;
    // The agent looks at the old mirror pod again and again while it is there.
    let looked = node.fake.requests(MIRROR);
    eventually(DEADLINE, || async {
        ensure!(
            node.fake.requests(MIRROR) >= looked + 3,
            "the mirror pod not looked at"
        );
        Ok(())
    })
    .await?;
    let held = node.fake.object(LEASE).context("lease")?;
    ensure!(
        held["spec"]["holderIdentity"] == "node-1_4f1d" && !copy.exists(),
        "while the old pod runs: lease {held}, new copy written: {}",
        copy.exists()
    );
    node.fake.remove_object(MIRROR);
    eventually(DEADLINE, || async {
        let c = read_yaml(&copy)?;
        ensure!(
            c["spec"]["containers"][0]["image"] == "kube-scheduler:v1.37.2",
            "{c}"
        );
        Ok(())
    })
    .await?;
    let lease = node.fake.object(LEASE).context("lease")?;
    ensure!(
        lease["spec"]["holderIdentity"] == ""
            && lease["spec"]["leaseDurationSeconds"] == 1
            && lease["spec"]["leaseTransitions"] == 2
            && lease["metadata"]["resourceVersion"] == "9",
        "lease once the old pod stopped: {lease}; agent: {}",
        agent.stderr()
    );
    ensure!(
        agent.stderr().contains("its leader lease released"),
        "{}",
        agent.stderr()
    );
    node.ensure_calls_allowed()
}

/// Going back starts with the stand-in moved out of the kubelet's directory, which makes the
/// kubelet stop the agent: the agent, still running meanwhile, must not write it back (it would
/// start again and follow kubeadm's files on, and `migrate-back` would find a manifest there).
#[tokio::test]
async fn kubeadm_sync_never_writes_its_stand_in_back_once_it_is_moved_out() -> Result<()> {
    let node = Node::new().await?;
    migrate(&node).await?;
    let agent = ChildProcess::spawn(node.agent(false), "kubeadm-sync")?;
    eventually(DEADLINE, || async {
        ensure!(
            agent.stderr().contains("following kubeadm's manifests"),
            "{}",
            agent.stderr()
        );
        Ok(())
    })
    .await?;
    let standin = node.dir.join("kubelet").join(APISERVER_STANDIN);
    std::fs::rename(&standin, node.dir.join("standin-aside.yaml"))?;
    eventually(DEADLINE, || async {
        ensure!(
            agent
                .stderr()
                .contains("the stand-in is gone from the kubelet's directory"),
            "{}",
            agent.stderr()
        );
        Ok(())
    })
    .await?;
    ensure!(
        !standin.exists(),
        "the stand-in was written back: {}",
        agent.stderr()
    );
    Ok(())
}

/// kubeadm (at `init`) and editors write a manifest in place: a pass may read it half-written,
/// even empty. The copy stays as it is until the file reads whole (removing it would make the
/// kubelet stop the pod: etcd, for etcd's).
#[tokio::test]
async fn kubeadm_sync_keeps_a_copy_while_its_source_is_half_written() -> Result<()> {
    let node = Node::new().await?;
    migrate(&node).await?;
    let agent = ChildProcess::spawn(node.agent(false), "kubeadm-sync")?;
    let copy = node.dir.join("kubelet/kube-scheduler.yaml");
    ensure!(copy.exists(), "no copy after the migration");
    std::fs::write(node.dir.join("manifests/kube-scheduler.yaml"), "")?;
    // Two passes over the empty file: the first one has ended.
    eventually(DEADLINE, || async {
        ensure!(
            agent.stderr().matches("manifest not copied").count() >= 2,
            "{}",
            agent.stderr()
        );
        Ok(())
    })
    .await?;
    ensure!(
        copy.exists(),
        "the copy was removed while its source was half-written: {}",
        agent.stderr()
    );
    Ok(())
}

/// A ServiceAccount token whose claims say it expires at 2100-01-01T00:00:00Z (its signature
/// is the apiserver's business, not the agent's).
const AGENT_TOKEN: &str = "eyJhbGciOiJSUzI1NiJ9.eyJleHAiOjQxMDI0NDQ4MDAsInN1YiI6InN5c3RlbTpzZXJ2aWNlYWNjb3VudDprdWJlLXN5c3RlbTprdWJlLWFwaXNlcnZlci1wcm94eS1rdWJlYWRtLXN5bmMifQ.c2ln";

/// `--write-kubeconfig` gives the agent its own identity with administrator credentials: the
/// ServiceAccount updated where it exists, each Role and binding created where it does not, a
/// token requested, and a kubeconfig with that token, the administrator's server and CA, 0600
/// in a 0700 directory. The agent started without its kubeconfig says how to write it (exit
/// 2, nothing written); so does `--write-kubeconfig` without administrator credentials.
#[tokio::test]
async fn kubeadm_sync_writes_its_own_kubeconfig_with_a_service_account_token() -> Result<()> {
    if !pyyaml() {
        return skip(
            "kubeadm_sync_writes_its_own_kubeconfig_with_a_service_account_token",
            "python3 with PyYAML is missing",
        );
    }
    const SA: &str =
        "/api/v1/namespaces/kube-system/serviceaccounts/kube-apiserver-proxy-kubeadm-sync";
    const RBAC: &str = "/apis/rbac.authorization.k8s.io/v1";
    let collections = [
        format!("{RBAC}/namespaces/kube-system/roles"),
        format!("{RBAC}/namespaces/kube-system/rolebindings"),
        format!("{RBAC}/clusterroles"),
        format!("{RBAC}/clusterrolebindings"),
    ];
    let token_path = format!("{SA}/token");
    let node = Node::with(|mut b| {
        b = b
            .object(SA, &json!({"apiVersion": "v1", "kind": "ServiceAccount",
                "metadata": {"name": "kube-apiserver-proxy-kubeadm-sync", "namespace": "kube-system"}}))
            .object(&token_path, &json!({"kind": "TokenRequest",
                "status": {"token": AGENT_TOKEN, "expirationTimestamp": "2100-01-01T00:00:00Z"}}));
        for c in &collections {
            b = b.object(c, &json!({}));
        }
        b
    })
    .await?;
    let kubeconfig = node.dir.join("kap/kubeadm-sync.conf");
    let write = |admin: &Path| {
        let mut c = Command::new(proxy_bin().expect("proxy binary"));
        c.args(["kubeadm-sync", "--write-kubeconfig", "--node-name=node-1"])
            .arg("--kubeadm-dir")
            .arg(node.dir.join("manifests"))
            .arg("--admin-kubeconfig")
            .arg(admin)
            .arg("--kubeconfig")
            .arg(&kubeconfig)
            .env_remove("RUST_LOG");
        c
    };
    // No administrator credentials: bad input, nothing asked, nothing written.
    let out = output(write(&node.dir.join("missing.conf"))).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(2) && stderr.contains("--admin-kubeconfig"),
        "{}: {stderr}",
        out.status
    );
    ensure!(node.fake.requests(&token_path) == 0 && !kubeconfig.exists());

    let out = output(write(&node.dir.join("admin.conf"))).await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "{}: {stderr}", out.status);
    ensure!(stderr.contains("2100-01-01T00:00:00Z"), "{stderr}");
    let sa = node.fake.object(SA).context("the ServiceAccount")?;
    ensure!(
        sa["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kube-apiserver-proxy",
        "the ServiceAccount was not updated: {sa}"
    );
    for c in &collections {
        ensure!(node.fake.requests(c) == 1, "{c} not created once");
    }
    ensure!(node.fake.requests(&token_path) == 1, "no token requested");
    let mode = |p: &Path| -> Result<u32> { Ok(std::fs::metadata(p)?.permissions().mode() & 0o777) };
    ensure!(mode(&kubeconfig)? == 0o600, "{:o}", mode(&kubeconfig)?);
    ensure!(mode(kubeconfig.parent().unwrap())? == 0o700);
    let written = read_yaml(&kubeconfig)?;
    ensure!(
        written["users"][0]["user"]["token"] == AGENT_TOKEN
            && written["clusters"][0]["cluster"]["server"]
                == format!("https://{}", node.fake.addr())
            && written["clusters"][0]["cluster"]["certificate-authority-data"].is_string(),
        "{written}"
    );

    // The agent without its kubeconfig: one line naming the command that writes it.
    std::fs::rename(node.dir.join("admin.conf"), node.dir.join("moved.conf"))?;
    let out = output(node.agent(true)).await?;
    let line = bad_input_line(&out, "the agent without its kubeconfig")?;
    ensure!(line.contains("--write-kubeconfig"), "{line}");
    ensure!(
        !node.dir.join("kubelet").exists()
            || std::fs::read_dir(node.dir.join("kubelet"))?
                .next()
                .is_none()
    );
    Ok(())
}

/// Runs `command` to its end off the test's runtime (the fake apiserver serves on it).
async fn output(mut command: Command) -> Result<std::process::Output> {
    Ok(tokio::task::spawn_blocking(move || command.output()).await??)
}
