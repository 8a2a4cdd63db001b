//! The canary of a change to etcd's static pod: before `kubeadm-sync` hands kubeadm's new
//! `etcd.yaml` to the kubelet, the new pod proves that it starts and serves the cluster's data,
//! beside the etcd that runs, which it never touches.
//!
//! A single-member etcd has no second member to keep serving while the one member restarts:
//! if the new etcd cannot start (a flag the new version rejects, an image that does not run,
//! data it refuses), etcd stays down until kubeadm's wait for the new pod (5 minutes by
//! default) fails and kubeadm puts its old manifest back, restoring its data backup too when the
//! old etcd does not come back (`phases/upgrade/staticpods.go`, `performEtcdStaticPodUpgrade`).
//! So the agent first runs the new pod as a *learner* of the running cluster:
//!
//! 1. a learner member is added (etcd's JSON gateway, `/v3/cluster/member/add`, with kubeadm's
//!    `healthcheck-client` certificate); a learner has no vote, so the running member keeps
//!    its quorum of one, and it serves neither watches nor writes: nothing is ever pointed at
//!    it (the apiserver names only `127.0.0.1:2379`; kubeadm's health checks skip learners);
//! 2. the new pod is written as the static pod `etcd-canary`: kubeadm's new manifest whole (its
//!    image, its flags, the operator's `extraArgs`), with its own name, its own loopback ports
//!    (`--etcd-canary-port`: clients, peers +1, metrics +2), its data in an `emptyDir` (never
//!    the running member's directory), `restartPolicy: Never`, none of kubeadm's labels
//!    (kubeadm counts the pods labelled `component=etcd`), none of its probes or ports (their
//!    port is the running member's);
//! 3. it passes once it answers a Status request as a learner that has applied the cluster's
//!    log up to where it stood when the learner was added (the whole database, received from
//!    the running member as a snapshot or its log, decoded and applied by the new version); it
//!    fails as soon as the kubelet reports its container stopped or its image unusable, or
//!    after the timeout;
//! 4. either way the learner is removed (it exits by itself) and the pod file deleted; the
//!    leftovers of an agent stopped half-way are removed before the next canary and when the
//!    agent starts.
//!
//! The learner joins a cluster of the old version: etcd admits a member of the next minor
//! (`cluster_util.go`), and the cluster's version stays the lowest member's, so nothing of the
//! running cluster changes (3.6 → 3.7 rehearsed in the real-kubelet stage).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::base::http_client::excerpt_of;
use crate::node::api::{ApiClient, ApiError};
use crate::node::kubeconfig::{self, Problem};
use crate::node::object::{self, Container, ObjectMeta, Pod, Volume};

/// The canary's file in the kubelet's directory.
const FILE: &str = "etcd-canary.yaml";
/// The canary's pod name (its mirror pod: `etcd-canary-<node>`).
const POD: &str = "etcd-canary";
/// The canary's etcd member name.
const MEMBER: &str = "kube-apiserver-proxy-canary";
/// How often the canary is asked.
const POLL: Duration = Duration::from_millis(500);
/// The kubeadm annotation that names etcd's client URLs.
const CLIENT_URLS: &str = "kubeadm.kubernetes.io/etcd.advertise-client-urls";
/// Container states in which the canary's image never runs.
const UNUSABLE: [&str; 7] = [
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// Why the canary did not pass, or could not run.
#[derive(Debug, thiserror::Error)]
pub enum CanaryError {
    #[error("the running etcd's client URL is not known (no {CLIENT_URLS} annotation, no --advertise-client-urls)")]
    NoEndpoint,
    #[error("the new etcd manifest has no container with a --{0} flag")]
    NoFlag(&'static str),
    #[error("the new etcd's --data-dir {0} is on no volume of its pod: the canary would share the running member's data")]
    DataDir(String),
    #[error("{path}: {source}")]
    Credentials {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("etcd's client credentials: {0}")]
    Client(#[source] Problem),
    #[error("etcd {what}: {source}")]
    Etcd {
        what: &'static str,
        #[source]
        source: ApiError,
    },
    #[error("etcd {what}: unexpected answer {answer}")]
    Answer { what: &'static str, answer: String },
    #[error("etcd has a member that has not started ({0}): another member is being added; no canary beside it")]
    Unstarted(String),
    #[error("write {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the new etcd stopped: {0}")]
    Stopped(String),
    #[error("etcd's pod: {0}")]
    Pod(#[from] crate::node::object::ObjectError),
    #[error("the new etcd did not serve within {after:?}: {last}")]
    Timeout { after: Duration, last: String },
}

/// The canary of one change (module documentation).
#[derive(Debug)]
pub struct Canary<'a> {
    /// The kubelet's static pod directory.
    pub static_pod_dir: &'a Path,
    /// The canary's client port on 127.0.0.1; its peer port is the next, its metrics port the
    /// one after.
    pub port: u16,
    pub timeout: Duration,
}

/// A canary that passed: the version it reported, and how long it took from the learner's
/// addition.
#[derive(Debug)]
pub struct Served {
    pub version: String,
    pub took: Duration,
}

impl Canary<'_> {
    fn file(&self) -> PathBuf {
        self.static_pod_dir.join(FILE)
    }

    fn peer_url(&self, scheme: &str) -> String {
        format!("{scheme}://127.0.0.1:{}", self.port + 1)
    }

    /// Runs the canary of `new` (kubeadm's new etcd manifest) beside `running` (the copy the
    /// kubelet runs); `mirror` reads the canary's mirror pod (`etcd-canary-<node>`), for the
    /// kubelet's view of its container. Blocks until it passed or failed; removes it either
    /// way.
    pub fn run(
        &self,
        running: &Pod,
        new: &Pod,
        mirror: &dyn Fn() -> Option<Pod>,
    ) -> Result<Served, CanaryError> {
        let rt = runtime();
        let etcd = Etcd::of(running, new, self.port, &rt)?;
        self.clean(&etcd)?;
        let result = self.attempt(&etcd, new, mirror);
        let cleaned = self.clean(&etcd);
        let served = result?;
        cleaned?;
        Ok(served)
    }

    /// Whether an earlier canary's pod file is there (an agent stopped half-way).
    pub fn left_behind(&self) -> bool {
        self.file().exists()
    }

    /// Removes what an earlier canary left (its pod file, its learner member), `running` being
    /// etcd's copy: when the agent starts.
    pub fn clean_up(&self, running: &Pod) -> Result<(), CanaryError> {
        let rt = runtime();
        self.clean(&Etcd::of(running, running, self.port, &rt)?)
    }

    fn attempt(
        &self,
        etcd: &Etcd<'_>,
        new: &Pod,
        mirror: &dyn Fn() -> Option<Pod>,
    ) -> Result<Served, CanaryError> {
        let schemes = Schemes::of(new)?;
        let status: Status = etcd.call(&etcd.member, "status", STATUS, &json!({}))?;
        let index = status
            .raft_index
            .get()
            .ok_or_else(|| answer("status", &status))?;
        let added: Added = etcd.call(
            &etcd.member,
            "member add",
            "/v3/cluster/member/add",
            &json!({"peerURLs": [self.peer_url(&schemes.peer)], "isLearner": true}),
        )?;
        let cluster = initial_cluster(&added)?;
        let uid = crate::node::manifest::sha256_hex(
            format!(
                "{}\n{:?}",
                self.static_pod_dir.display(),
                SystemTime::now().duration_since(UNIX_EPOCH)
            )
            .as_bytes(),
        )[..32]
            .to_owned();
        let pod = canary_pod(new, &uid, self.port, &schemes, &cluster)?;
        let file = self.file();
        let text = crate::base::yaml::to_yaml(&object::to_value(&pod));
        crate::base::fsutil::write_atomic(&file, text.as_bytes()).map_err(|source| {
            CanaryError::Write {
                path: file.display().to_string(),
                source,
            }
        })?;
        let started = Instant::now();
        loop {
            let last = match etcd.call::<Status>(&etcd.canary, "status", STATUS, &json!({})) {
                Ok(s) => match (s.raft_applied_index.and_then(|n| n.get()), s.version) {
                    (Some(applied), Some(version)) if applied >= index => {
                        return Ok(Served {
                            version,
                            took: started.elapsed(),
                        })
                    }
                    (applied, _) => format!("applied index {applied:?}, the cluster's was {index}"),
                },
                Err(e) => e.to_string(),
            };
            if let Some(why) = mirror().and_then(|m| stopped(&m, &uid)) {
                return Err(CanaryError::Stopped(why));
            }
            if started.elapsed() > self.timeout {
                return Err(CanaryError::Timeout {
                    after: self.timeout,
                    last,
                });
            }
            std::thread::sleep(POLL);
        }
    }

    /// Removes the canary's member (it exits by itself) and its pod file: the file even when
    /// etcd cannot be asked (the kubelet then stops the learner; the member is removed next
    /// time).
    fn clean(&self, etcd: &Etcd<'_>) -> Result<(), CanaryError> {
        let members = self.remove_members(etcd);
        let file = self.file();
        let removed = match std::fs::remove_file(&file) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(CanaryError::Write {
                path: file.display().to_string(),
                source,
            }),
        };
        members.and(removed)
    }

    /// Removes the canary's learner members.
    fn remove_members(&self, etcd: &Etcd<'_>) -> Result<(), CanaryError> {
        let list: Members = etcd.call(
            &etcd.member,
            "member list",
            "/v3/cluster/member/list",
            &json!({}),
        )?;
        let port = format!(":{}", self.port + 1);
        for m in list.members {
            let ours = m.name == MEMBER
                || m.peer_urls
                    .iter()
                    .any(|u| u.contains("://127.0.0.1:") && u.ends_with(&port));
            if ours && m.is_learner {
                let _: Value = etcd.call(
                    &etcd.member,
                    "member remove",
                    "/v3/cluster/member/remove",
                    &json!({"ID": m.id}),
                )?;
                tracing::info!(member = %m.id.map(|id| id.to_string()).unwrap_or_default(),
                    "kubeadm-sync: the etcd canary's learner removed");
            }
        }
        Ok(())
    }
}

fn runtime() -> tokio::runtime::Runtime {
    crate::base::runtime::current_thread().expect("tokio runtime")
}

fn answer(what: &'static str, v: &impl Serialize) -> CanaryError {
    CanaryError::Answer {
        what,
        answer: excerpt_of(&object::to_value(v).to_string(), 300),
    }
}

/// etcd's Status request (its JSON gateway's path).
const STATUS: &str = "/v3/maintenance/status";

/// A uint64 of etcd's JSON gateway: a string (grpc-gateway's rendering of 64-bit numbers), or a
/// number; kept as it came, to be sent back the same way (a member's ID).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
enum Uint64 {
    Number(u64),
    Text(String),
}

impl Uint64 {
    fn get(&self) -> Option<u64> {
        match self {
            Uint64::Number(n) => Some(*n),
            Uint64::Text(t) => t.parse().ok(),
        }
    }
}

impl std::fmt::Display for Uint64 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Uint64::Number(n) => write!(f, "{n}"),
            Uint64::Text(t) => f.write_str(t),
        }
    }
}

/// The answer to a Status request (`etcdserverpb.StatusResponse`, the fields read).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Status {
    raft_index: Uint64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    raft_applied_index: Option<Uint64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    version: Option<String>,
}

/// A member of the cluster (`etcdserverpb.Member`): a learner that has not started has no name.
#[derive(Debug, Serialize, Deserialize)]
struct Member {
    #[serde(rename = "ID", default, skip_serializing_if = "Option::is_none")]
    id: Option<Uint64>,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    name: String,
    #[serde(rename = "peerURLs", default)]
    peer_urls: Vec<String>,
    #[serde(rename = "isLearner", default)]
    is_learner: bool,
}

/// The answer to a member list.
#[derive(Debug, Deserialize)]
struct Members {
    #[serde(default)]
    members: Vec<Member>,
}

/// The answer to a member add: the member added, and every member with it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Added {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    member: Option<Member>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    members: Option<Vec<Member>>,
}

/// The two etcd servers the canary speaks to: the running member and the canary itself.
struct Etcd<'a> {
    rt: &'a tokio::runtime::Runtime,
    member: ApiClient,
    canary: ApiClient,
}

impl<'a> Etcd<'a> {
    /// Clients of the running member (its client URL in `running`) and of the canary (its
    /// port), with the `healthcheck-client` certificate kubeadm makes beside etcd's CA (the
    /// directory of `new`'s `--trusted-ca-file`: a custom `certificatesDir` is followed).
    fn of(
        running: &Pod,
        new: &Pod,
        canary_port: u16,
        rt: &'a tokio::runtime::Runtime,
    ) -> Result<Etcd<'a>, CanaryError> {
        let (host, port) = client_url(running).ok_or(CanaryError::NoEndpoint)?;
        let ca = PathBuf::from(
            flag(new, "trusted-ca-file").ok_or(CanaryError::NoFlag("trusted-ca-file"))?,
        );
        let dir = ca.parent().unwrap_or(Path::new("/"));
        let read = |p: PathBuf| {
            std::fs::read(&p).map_err(|source| CanaryError::Credentials {
                path: p.display().to_string(),
                source,
            })
        };
        let (ca, cert, key) = (
            read(ca.clone())?,
            read(dir.join("healthcheck-client.crt"))?,
            read(dir.join("healthcheck-client.key"))?,
        );
        let client = |h: &str, p: u16| {
            ApiClient::mutual(h, p, ca.clone(), cert.clone(), key.clone())
                .map_err(CanaryError::Client)
        };
        Ok(Etcd {
            rt,
            member: client(&host, port)?,
            canary: client("127.0.0.1", canary_port)?,
        })
    }

    /// `POST path` with `body` to `to`; its answer as a `T` (else the answer, cut, in the error).
    fn call<T: DeserializeOwned>(
        &self,
        to: &ApiClient,
        what: &'static str,
        path: &str,
        body: &Value,
    ) -> Result<T, CanaryError> {
        let v = self
            .rt
            .block_on(to.send_json("POST", path, body))
            .map_err(|source| CanaryError::Etcd { what, source })?;
        T::deserialize(&v).map_err(|_| answer(what, &v))
    }
}

/// The schemes of the new etcd's URLs (kubeadm's: https for clients and peers, http for
/// metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schemes {
    client: String,
    peer: String,
    metrics: Option<String>,
}

impl Schemes {
    fn of(pod: &Pod) -> Result<Self, CanaryError> {
        let scheme = |name: &'static str| {
            flag(pod, name).map(|v| v.split("://").next().unwrap_or("https").to_owned())
        };
        Ok(Schemes {
            client: scheme("listen-client-urls")
                .ok_or(CanaryError::NoFlag("listen-client-urls"))?,
            peer: scheme("listen-peer-urls").ok_or(CanaryError::NoFlag("listen-peer-urls"))?,
            metrics: scheme("listen-metrics-urls"),
        })
    }
}

/// The index of etcd's container in a pod: the one named `etcd`, else the first.
fn container_index(pod: &Pod) -> Option<usize> {
    let cs = &pod.spec.as_ref()?.containers;
    cs.iter()
        .position(|c| c.name == "etcd")
        .or((!cs.is_empty()).then_some(0))
}

/// etcd's container in a pod ([`container_index`]).
fn container(pod: &Pod) -> Option<&Container> {
    pod.spec.as_ref()?.containers.get(container_index(pod)?)
}

/// The value of `--name=value` in etcd's container's command and arguments.
fn flag(pod: &Pod, name: &str) -> Option<String> {
    let c = container(pod)?;
    let prefix = format!("--{name}=");
    [&c.command, &c.args]
        .into_iter()
        .flatten()
        .flatten()
        .find_map(|a| a.strip_prefix(&prefix).map(str::to_owned))
}

/// The running member's client URL, as kubeadm's own etcd client finds it: the pod's
/// `kubeadm.kubernetes.io/etcd.advertise-client-urls` annotation, else its
/// `--advertise-client-urls`; the first, as host and port.
pub fn client_url(pod: &Pod) -> Option<(String, u16)> {
    let urls = object::annotation(&pod.metadata, CLIENT_URLS)
        .map(str::to_owned)
        .or_else(|| flag(pod, "advertise-client-urls"))?;
    kubeconfig::host_port(urls.split(',').next()?.trim())
}

/// `--initial-cluster` for the learner from the answer of its member add: every member's
/// `name=peerURL`, the learner (no name yet) as the canary.
pub fn initial_cluster(added: &Added) -> Result<String, CanaryError> {
    let id = added.member.as_ref().and_then(|m| m.id.as_ref());
    let members = added
        .members
        .as_ref()
        .ok_or_else(|| answer("member add", added))?;
    let mut out = Vec::new();
    for m in members {
        let name = match m.name.as_str() {
            "" if m.id.as_ref() == id => MEMBER,
            "" => return Err(CanaryError::Unstarted(object::to_value(m).to_string())),
            n => n,
        };
        for url in &m.peer_urls {
            out.push(format!("{name}={url}"));
        }
    }
    Ok(out.join(","))
}

/// The canary's pod: `new` with its own name, UID, ports, member name and cluster, its data
/// in an `emptyDir` instead of the volume its `--data-dir` is on, no probes (a learner is never
/// ready: `/readyz` fails on learners) and no ports (kubeadm's name the running member's
/// metrics port, which the kubelet admits once on the host network), never restarted, none of
/// kubeadm's labels or annotations.
pub fn canary_pod(
    new: &Pod,
    uid: &str,
    port: u16,
    schemes: &Schemes,
    cluster: &str,
) -> Result<Pod, CanaryError> {
    let data = flag(new, "data-dir").ok_or(CanaryError::NoFlag("data-dir"))?;
    // There is one: `data-dir` was found in it.
    let i = container_index(new).ok_or(CanaryError::NoFlag("data-dir"))?;
    let mut pod = new.clone();
    pod.metadata = ObjectMeta {
        name: Some(POD.to_owned()),
        namespace: Some(
            new.metadata
                .namespace
                .clone()
                .unwrap_or_else(|| "kube-system".to_owned()),
        ),
        uid: Some(uid.to_owned()),
        labels: Some(
            [
                ("app.kubernetes.io/name", POD),
                ("app.kubernetes.io/part-of", "kube-apiserver-proxy"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .into(),
        ),
        ..ObjectMeta::default()
    };
    let spec = pod.spec.get_or_insert_with(Default::default);
    spec.restart_policy = Some("Never".to_owned());
    let c = &mut spec.containers[i];
    let volume = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| {
            let p = m.mount_path.trim_end_matches('/');
            data.trim_end_matches('/') == p || data.starts_with(&format!("{p}/"))
        })
        .map(|m| m.name.clone())
        .ok_or_else(|| CanaryError::DataDir(data.clone()))?;
    // kubeadm's probes, and the port they name (on the host network: the running member's
    // 2381, which the kubelet would refuse to admit twice).
    c.liveness_probe = None;
    c.readiness_probe = None;
    c.startup_probe = None;
    c.ports = None;
    // Why it stopped, for the agent's log: the end of its output when it wrote no message.
    c.termination_message_policy = Some("FallbackToLogsOnError".to_owned());
    let client = format!("{}://127.0.0.1:{port}", schemes.client);
    let peer = format!("{}://127.0.0.1:{}", schemes.peer, port + 1);
    let mut set = vec![
        ("name", MEMBER.to_owned()),
        ("listen-client-urls", client.clone()),
        ("advertise-client-urls", client),
        ("listen-peer-urls", peer.clone()),
        ("initial-advertise-peer-urls", peer),
        ("initial-cluster", cluster.to_owned()),
        ("initial-cluster-state", "existing".to_owned()),
    ];
    if let Some(m) = &schemes.metrics {
        set.push((
            "listen-metrics-urls",
            format!("{m}://127.0.0.1:{}", port + 2),
        ));
    }
    let drop = ["listen-client-http-urls"];
    let words = if c.command.iter().flatten().any(|s| s.starts_with("--")) {
        &mut c.command
    } else {
        &mut c.args
    };
    let mut out: Vec<String> = words
        .take()
        .unwrap_or_default()
        .into_iter()
        .filter(|a| {
            let name = a
                .strip_prefix("--")
                .map(|s| s.split('=').next().unwrap_or(s));
            !matches!(name, Some(n) if set.iter().any(|(k, _)| *k == n) || drop.contains(&n))
        })
        .collect();
    out.extend(set.iter().map(|(k, v)| format!("--{k}={v}")));
    *words = Some(out);
    for v in spec.volumes.iter_mut().flatten() {
        if v.name == volume {
            *v = Volume {
                name: volume.clone(),
                empty_dir: Some(Default::default()),
                ..Volume::default()
            };
        }
    }
    Ok(pod)
}

/// Why the canary's container will not serve, from its mirror pod as the kubelet reports it
/// (only the mirror pod of this canary, `uid`): stopped (its exit code, reason and message), or
/// an image that cannot run.
pub fn stopped(mirror: &Pod, uid: &str) -> Option<String> {
    if object::annotation(&mirror.metadata, object::MIRROR_OF) != Some(uid) {
        return None;
    }
    let status = mirror.status.as_ref()?;
    for s in status.container_statuses.iter().flatten() {
        let state = s.state.as_ref();
        if let Some(t) = state.and_then(|s| s.terminated.as_ref()) {
            return Some(format!(
                "exit code {}, {}{}",
                t.exit_code,
                t.reason.as_deref().unwrap_or("terminated"),
                t.message
                    .as_deref()
                    .and_then(telling_line)
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            ));
        }
        let waiting = state.and_then(|s| s.waiting.as_ref());
        if let Some((reason, w)) = waiting
            .and_then(|w| Some((w.reason.as_deref()?, w)))
            .filter(|(r, _)| UNUSABLE.contains(r))
        {
            return Some(format!(
                "{reason}{}",
                w.message
                    .as_deref()
                    .map(|m| format!(": {m}"))
                    .unwrap_or_default()
            ));
        }
    }
    (status.phase.as_deref() == Some("Failed")).then(|| "its pod failed".to_owned())
}

/// The line of a stopped container's message (its output's end, `FallbackToLogsOnError`) that
/// says why: the last that names an error (etcd prints its usage after a flag it rejects, and
/// logs other lines before a fatal one), else the last; at most 300 characters.
fn telling_line(message: &str) -> Option<String> {
    const WORDS: [&str; 6] = [
        "fatal",
        "panic",
        "error",
        "not defined",
        "invalid",
        "failed",
    ];
    let lines: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let line = lines
        .iter()
        .rev()
        .find(|l| {
            let l = l.to_ascii_lowercase();
            WORDS.iter().any(|w| l.contains(w))
        })
        .or(lines.last())?;
    Some(excerpt_of(line, 300))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// kubeadm v1.37's etcd manifest, as `kubeadm init` writes it.
    fn kubeadm_etcd(image: &str, extra: &[&str]) -> Pod {
        object::from_value(kubeadm_etcd_json(image, extra)).unwrap()
    }

    fn kubeadm_etcd_json(image: &str, extra: &[&str]) -> Value {
        let mut command = vec![
            "etcd",
            "--advertise-client-urls=https://192.0.2.10:2379",
            "--cert-file=/etc/kubernetes/pki/etcd/server.crt",
            "--client-cert-auth=true",
            "--data-dir=/var/lib/etcd",
            "--initial-advertise-peer-urls=https://192.0.2.10:2380",
            "--initial-cluster=node-1=https://192.0.2.10:2380",
            "--key-file=/etc/kubernetes/pki/etcd/server.key",
            "--listen-client-urls=https://127.0.0.1:2379,https://192.0.2.10:2379",
            "--listen-metrics-urls=http://127.0.0.1:2381",
            "--listen-peer-urls=https://192.0.2.10:2380",
            "--name=node-1",
            "--trusted-ca-file=/etc/kubernetes/pki/etcd/ca.crt",
        ];
        command.extend(extra);
        json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "etcd", "namespace": "kube-system",
                "labels": {"component": "etcd", "tier": "control-plane"},
                "annotations": {CLIENT_URLS: "https://192.0.2.10:2379"}},
            "spec": {"hostNetwork": true, "priorityClassName": "system-node-critical",
                "containers": [{"name": "etcd", "image": image, "command": command,
                    "livenessProbe": {"httpGet": {"host": "127.0.0.1", "path": "/livez", "port": 2381}},
                    "startupProbe": {"httpGet": {"host": "127.0.0.1", "path": "/readyz", "port": "probe-port"}},
                    "ports": [{"containerPort": 2381, "name": "probe-port", "protocol": "TCP"}],
                    "volumeMounts": [{"mountPath": "/var/lib/etcd", "name": "etcd-data"},
                        {"mountPath": "/etc/kubernetes/pki/etcd", "name": "etcd-certs"}]}],
                "volumes": [{"name": "etcd-certs", "hostPath": {"path": "/etc/kubernetes/pki/etcd", "type": "DirectoryOrCreate"}},
                    {"name": "etcd-data", "hostPath": {"path": "/var/lib/etcd", "type": "DirectoryOrCreate"}}]}})
    }

    fn args(pod: &Pod) -> Vec<String> {
        pod.spec.as_ref().unwrap().containers[0]
            .command
            .clone()
            .unwrap()
    }

    #[test]
    fn the_canary_is_the_new_pod_on_its_own_ports_and_data() {
        let new = kubeadm_etcd(
            "registry.k8s.io/etcd:3.7.0-0",
            &["--quota-backend-bytes=8589934592"],
        );
        let schemes = Schemes::of(&new).unwrap();
        let cluster =
            "node-1=https://192.0.2.10:2380,kube-apiserver-proxy-canary=https://127.0.0.1:2480";
        let pod = canary_pod(&new, "u1", 2479, &schemes, cluster).unwrap();
        let a = args(&pod);
        for want in [
            "--name=kube-apiserver-proxy-canary",
            "--listen-client-urls=https://127.0.0.1:2479",
            "--advertise-client-urls=https://127.0.0.1:2479",
            "--listen-peer-urls=https://127.0.0.1:2480",
            "--initial-advertise-peer-urls=https://127.0.0.1:2480",
            "--listen-metrics-urls=http://127.0.0.1:2481",
            &format!("--initial-cluster={cluster}"),
            "--initial-cluster-state=existing",
            // kubeadm's and the operator's flags kept: what the canary is for.
            "--quota-backend-bytes=8589934592",
            "--client-cert-auth=true",
            "--data-dir=/var/lib/etcd",
        ] {
            assert!(a.iter().any(|x| x == want), "{want} not in {a:?}");
        }
        // Each flag once: the running member's ports and name are gone.
        for gone in ["2379", "2380", "2381", "--name=node-1"] {
            assert!(
                !a.iter()
                    .any(|x| x.contains(gone) && !x.starts_with("--initial-cluster=")),
                "{gone} in {a:?}"
            );
        }
        assert_eq!(a[0], "etcd");
        let spec = pod.spec.as_ref().unwrap();
        let c = &spec.containers[0];
        assert_eq!(c.image.as_deref(), Some("registry.k8s.io/etcd:3.7.0-0"));
        assert!(c.liveness_probe.is_none() && c.startup_probe.is_none());
        // No host port of the running member: the kubelet would not admit the pod (NodePorts).
        assert!(c.ports.is_none(), "{c:?}");
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert_eq!(
            c.termination_message_policy.as_deref(),
            Some("FallbackToLogsOnError")
        );
        // Its data never the running member's: the data volume is an emptyDir; the
        // certificates stay.
        let volumes = object::to_value(spec.volumes.as_ref().unwrap());
        let volumes = volumes.as_array().unwrap();
        assert!(
            volumes.contains(&json!({"name": "etcd-data", "emptyDir": {}})),
            "{volumes:?}"
        );
        assert!(volumes
            .iter()
            .any(|v| v["hostPath"]["path"] == "/etc/kubernetes/pki/etcd"));
        // Not one of kubeadm's etcd pods (kubeadm counts component=etcd).
        assert_eq!(pod.metadata.name.as_deref(), Some("etcd-canary"));
        assert_eq!(pod.metadata.uid.as_deref(), Some("u1"));
        assert!(!pod
            .metadata
            .labels
            .as_ref()
            .unwrap()
            .contains_key("component"));
        assert!(pod.metadata.annotations.is_none());
    }

    #[test]
    fn no_canary_on_the_running_members_data() {
        let mut new = kubeadm_etcd("etcd:3.7.0-0", &[]);
        new.spec.as_mut().unwrap().containers[0].volume_mounts = Some(vec![]);
        let schemes = Schemes::of(&new).unwrap();
        let e = canary_pod(&new, "u", 2479, &schemes, "x").unwrap_err();
        assert!(
            matches!(e, CanaryError::DataDir(ref d) if d == "/var/lib/etcd"),
            "{e}"
        );
    }

    #[test]
    fn the_learner_joins_every_member_by_name() {
        // etcd's JSON gateway, v3.6.16, answering a learner's addition.
        let added = json!({"member": {"ID": "42", "peerURLs": ["https://127.0.0.1:2480"], "isLearner": true},
            "members": [{"ID": "42", "peerURLs": ["https://127.0.0.1:2480"], "isLearner": true},
                {"ID": "7", "name": "node-1", "peerURLs": ["https://192.0.2.10:2380"], "clientURLs": ["https://192.0.2.10:2379"]}]});
        let added: Added = serde_json::from_value(added).unwrap();
        assert_eq!(
            initial_cluster(&added).unwrap(),
            "kube-apiserver-proxy-canary=https://127.0.0.1:2480,node-1=https://192.0.2.10:2380"
        );
        let mut other = added;
        other.members.as_mut().unwrap().push(
            serde_json::from_value(json!({"ID": "9", "peerURLs": ["https://192.0.2.11:2380"]}))
                .unwrap(),
        );
        assert!(matches!(
            initial_cluster(&other),
            Err(CanaryError::Unstarted(_))
        ));
    }

    #[test]
    fn an_unexpected_answer_is_cut_on_a_character() {
        // 7 bytes of `{"ab":"`, then two-byte characters: byte 300 falls inside one.
        let e = answer("status", &json!({"ab": "é".repeat(400)}));
        let CanaryError::Answer { answer, .. } = e else {
            panic!("{e}")
        };
        assert_eq!(answer.chars().count(), 300);
        assert!(answer.starts_with("{\"ab\":\"éé"));
    }

    #[test]
    fn the_running_members_url_as_kubeadm_finds_it() {
        let pod = kubeadm_etcd("etcd:3.6.16-0", &[]);
        assert_eq!(client_url(&pod), Some(("192.0.2.10".into(), 2379)));
        let mut bare = pod.clone();
        bare.metadata.annotations = Some(Default::default());
        assert_eq!(client_url(&bare), Some(("192.0.2.10".into(), 2379)));
        bare.spec.as_mut().unwrap().containers[0].command = Some(vec!["etcd".into()]);
        assert_eq!(client_url(&bare), None);
        let number = |v: Value| serde_json::from_value::<Uint64>(v).unwrap().get();
        assert_eq!(number(json!("18446744073709551615")), Some(u64::MAX));
        assert_eq!(number(json!(4)), Some(4));
        // An ID goes back as it came.
        let id: Uint64 = serde_json::from_value(json!("42")).unwrap();
        assert_eq!(json!({"ID": id}), json!({"ID": "42"}));
    }

    #[test]
    fn a_stopped_canary_is_seen_with_its_reason() {
        let mirror = |uid: &str, state: Value| -> Pod {
            object::inspect(json!({"metadata": {"annotations": {"kubernetes.io/config.mirror": uid}},
                "status": {"phase": "Running", "containerStatuses": [{"name": "etcd", "image": "etcd",
                    "imageID": "", "ready": false, "restartCount": 0, "state": state}]}}), "Pod").unwrap()
        };
        let exited = json!({"terminated": {"exitCode": 2, "reason": "Error", "message": "flag provided but not defined: -kap
"}});
        assert_eq!(
            stopped(&mirror("u1", exited.clone()), "u1").as_deref(),
            Some("exit code 2, Error: flag provided but not defined: -kap")
        );
        // etcd's own output: the line that says why, not its usage text or earlier logs.
        let usage = json!({"terminated": {"exitCode": 2, "reason": "Error",
            "message": "flag provided but not defined: -kap\nUsage:\n\n  etcd [flags]\n    Start an etcd server.\n"}});
        assert_eq!(
            stopped(&mirror("u1", usage), "u1").as_deref(),
            Some("exit code 2, Error: flag provided but not defined: -kap")
        );
        let fatal = json!({"terminated": {"exitCode": 1, "reason": "Error",
            "message": "{\"level\":\"info\",\"msg\":\"starting\"}\n{\"level\":\"fatal\",\"msg\":\"discovery failed\"}\n"}});
        assert_eq!(
            stopped(&mirror("u1", fatal), "u1").as_deref(),
            Some("exit code 1, Error: {\"level\":\"fatal\",\"msg\":\"discovery failed\"}")
        );
        // Another canary's mirror pod (an earlier one, not yet deleted): not this one's.
        assert_eq!(stopped(&mirror("u0", exited), "u1"), None);
        let pull = json!({"waiting": {"reason": "ErrImagePull", "message": "not found"}});
        assert_eq!(
            stopped(&mirror("u1", pull), "u1").as_deref(),
            Some("ErrImagePull: not found")
        );
        let creating = json!({"waiting": {"reason": "ContainerCreating"}});
        assert_eq!(stopped(&mirror("u1", creating), "u1"), None);
        let running = json!({"running": {"startedAt": "2026-12-05T00:00:00Z"}});
        assert_eq!(stopped(&mirror("u1", running), "u1"), None);
    }
}
