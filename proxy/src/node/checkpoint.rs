//! The last-known-good checkpoint, written by the `recover` node agent: the newest pod of the
//! apiserver Deployment on this node that has been Ready, without a break, for
//! `--checkpoint-after`, as a static pod.
//!
//! "Ready" is the pod's `Ready` condition and its `lastTransitionTime`: both containers ready,
//! i.e. the proxy Serving and this pod's apiserver passing `/readyz`. The pod of a broken
//! rollout never gets there, so it never becomes the checkpoint; a pod that flaps starts its
//! wait again. What is written is that very pod, never the Deployment's template, which during
//! a rollout may already be the broken one.
//!
//! The pods are read with the node's own identity (the kubelet's kubeconfig; the Node
//! authorizer lets it read the pods bound to this node, which root on the node can do anyway),
//! so the apiserver pod itself carries no API credential: a service account token volume would
//! need the API to be mounted, and the pod could then never start while it is the only
//! apiserver.
//!
//! A pod is written only if it is the told workload's (its controller owner references lead
//! there, uids compared through the API) and passes [`staticpod::validate`], the rules `recover`
//! applies again before activating it: a refusal is reported while there is an API, not found
//! at boot. The kubeconfig is read at every attempt (the kubelet rotates its certificate).
//!
//! Files in the checkpoint directory: [`FILE`] (the checkpoint) and [`PREVIOUS`] (the one it
//! replaced, for an operator's manual fallback); nothing else is kept. A checkpoint of a newer
//! pod (by `creationTimestamp`) is never replaced by an older pod's.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use hyper::StatusCode;
use serde_json::Value;

use crate::base::fsutil::write_durable;
use crate::node::api::{ApiClient, ApiError};
use crate::node::kubeconfig::KubeconfigError;
use crate::node::staticpod::{self, Origin};

/// The checkpoint's file name in the checkpoint directory.
pub const FILE: &str = "kube-apiserver.json";
/// The checkpoint it replaced.
pub const PREVIOUS: &str = "kube-apiserver.previous.json";

/// Why an attempt failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Kubeconfig(#[from] KubeconfigError),
    #[error("GET {path}: {source}")]
    Api {
        path: String,
        #[source]
        source: ApiError,
    },
    #[error("pod {pod} is unusable as a checkpoint: {source}")]
    Unusable {
        pod: String,
        #[source]
        source: staticpod::Unusable,
    },
    #[error("{path}: {source}")]
    File {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// The workload whose pods may become the checkpoint (`recover --workload`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Workload {
    /// Its pods are owned by a ReplicaSet that this Deployment owns.
    Deployment(String),
    /// Its pods are owned by this DaemonSet.
    DaemonSet(String),
}

impl std::str::FromStr for Workload {
    type Err = WorkloadError;

    fn from_str(s: &str) -> Result<Self, WorkloadError> {
        match s.split_once('/') {
            Some(("deployment", name)) if !name.is_empty() => Ok(Workload::Deployment(name.into())),
            Some(("daemonset", name)) if !name.is_empty() => Ok(Workload::DaemonSet(name.into())),
            _ => Err(WorkloadError(s.to_owned())),
        }
    }
}

/// A `--workload` that is neither `deployment/NAME` nor `daemonset/NAME`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not deployment/NAME or daemonset/NAME")]
pub struct WorkloadError(pub String);

impl std::fmt::Display for Workload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Workload::Deployment(n) => write!(f, "deployment/{n}"),
            Workload::DaemonSet(n) => write!(f, "daemonset/{n}"),
        }
    }
}

/// What the writer reads and where it writes.
#[derive(Debug, Clone)]
pub struct WriterConfig {
    /// The checkpoint directory (persistent, root-only).
    pub dir: PathBuf,
    /// The Deployment's namespace.
    pub namespace: String,
    /// Label selector of the Deployment's pods.
    pub selector: String,
    /// The workload a pod must belong to (through its owner references) to be written.
    pub workload: Workload,
    /// This node's name (pods bound to it).
    pub node: String,
    /// How long a pod must have been Ready without a break.
    pub after: Duration,
    /// Given to the recovery instance's proxy as `--retire-file`.
    pub retire_file: String,
    /// The node's kubeconfig, read again at every attempt: the kubelet rotates the client
    /// certificate it names.
    pub kubeconfig: PathBuf,
    /// What a checkpoint may hold: the rules `recover` applies again at boot.
    pub policy: staticpod::Policy,
}

/// What an attempt came to.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// This pod is now the checkpoint.
    Written(String),
    /// No pod qualifies yet.
    NoCandidate,
    /// The checkpoint is of this pod already: it is current.
    Current,
    /// The checkpoint is kept as it is (why).
    Kept(&'static str),
    /// The pod that qualifies would be refused at boot, or does not belong to the workload:
    /// not written, the checkpoint kept.
    Refused { pod: String, reason: String },
}

/// Whether a checkpoint of `existing` may be replaced by one of `ours`.
pub fn replaces(existing: Option<&Origin>, ours: &Origin) -> Result<(), &'static str> {
    match existing {
        None => Ok(()),
        Some(e) if e.uid == ours.uid => Err("this pod is already the checkpoint"),
        Some(e) if e.created > ours.created => Err("the checkpoint is of a newer pod"),
        Some(_) => Ok(()),
    }
}

/// Since when `pod` has been Ready, if it is.
pub fn ready_since(pod: &Value) -> Option<SystemTime> {
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready" && c["status"] == "True")
        .and_then(|c| c["lastTransitionTime"].as_str())
        .and_then(|t| humantime::parse_rfc3339(t).ok())
}

/// The pod to checkpoint among `pods` (a pod list's items) at `now`: not a mirror pod, not
/// being deleted, Ready without a break for `after`; the newest such by `creationTimestamp`.
pub fn choose(pods: &[Value], now: SystemTime, after: Duration) -> Option<&Value> {
    pods.iter()
        .filter(|p| {
            p["metadata"]["annotations"]
                .get("kubernetes.io/config.mirror")
                .is_none()
                && p["metadata"].get("deletionTimestamp").is_none()
                && ready_since(p).is_some_and(|t| now.duration_since(t).is_ok_and(|d| d >= after))
        })
        .max_by(|a, b| {
            let created = |p: &Value| {
                p["metadata"]["creationTimestamp"]
                    .as_str()
                    .map(str::to_owned)
            };
            created(a).cmp(&created(b))
        })
}

/// The controller owner reference of `object` (kind, name, uid), if it has one.
pub fn controller_of(object: &Value) -> Option<(&str, &str, &str)> {
    object["metadata"]["ownerReferences"]
        .as_array()?
        .iter()
        .find(|r| r["controller"] == true)
        .and_then(|r| Some((r["kind"].as_str()?, r["name"].as_str()?, r["uid"].as_str()?)))
}

/// Why a pod is not one of the workload's: its controller owner references do not lead there.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotOwned {
    #[error("{0} does not exist")]
    Missing(String),
    #[error("it has no controller owner reference (not made by {0})")]
    NoController(Workload),
    #[error("its controller is {kind} {owner}, not a {want} of {workload}")]
    Kind {
        kind: String,
        owner: String,
        want: &'static str,
        workload: Workload,
    },
    #[error("{path} has another uid than the owner reference names ({uid})")]
    Uid { path: String, uid: String },
    #[error("its owner is {owner}, not {workload}")]
    Owner { owner: String, workload: Workload },
    #[error("its ReplicaSet {replicaset} belongs to deployment/{deployment}, not {workload}")]
    Deployment {
        replicaset: String,
        deployment: String,
        workload: Workload,
    },
    #[error("its ReplicaSet {replicaset} is not controlled by {workload}")]
    Uncontrolled {
        replicaset: String,
        workload: Workload,
    },
}

/// Follows `pod`'s controller owner references up to `workload`, reading each owner from the
/// API and comparing uids: `Ok(Err(why))` when the chain does not lead there.
async fn owned_by(
    api: &ApiClient,
    namespace: &str,
    pod: &Value,
    workload: &Workload,
) -> Result<Result<(), NotOwned>, CheckpointError> {
    let get = |path: String| async move {
        match api.get_json(&path).await {
            Ok(v) => Ok(Ok(v)),
            Err(e) if e.status() == Some(StatusCode::NOT_FOUND) => Ok(Err(NotOwned::Missing(path))),
            Err(source) => Err(CheckpointError::Api { path, source }),
        }
    };
    let (want, name) = match workload {
        Workload::Deployment(n) => ("ReplicaSet", n),
        Workload::DaemonSet(n) => ("DaemonSet", n),
    };
    let Some((kind, owner, uid)) = controller_of(pod) else {
        return Ok(Err(NotOwned::NoController(workload.clone())));
    };
    if kind != want {
        return Ok(Err(NotOwned::Kind {
            kind: kind.to_owned(),
            owner: owner.to_owned(),
            want,
            workload: workload.clone(),
        }));
    }
    let apps = format!("/apis/apps/v1/namespaces/{namespace}");
    let mut path = match workload {
        Workload::Deployment(_) => format!("{apps}/replicasets/{owner}"),
        Workload::DaemonSet(_) => format!("{apps}/daemonsets/{owner}"),
    };
    let (mut owner, mut uid) = (owner.to_owned(), uid.to_owned());
    loop {
        let object = match get(path.clone()).await? {
            Ok(o) => o,
            Err(why) => return Ok(Err(why)),
        };
        if object["metadata"]["uid"].as_str() != Some(uid.as_str()) {
            return Ok(Err(NotOwned::Uid { path, uid }));
        }
        if object["kind"] != "ReplicaSet" {
            // The workload itself.
            return Ok(if owner == *name {
                Ok(())
            } else {
                Err(NotOwned::Owner {
                    owner,
                    workload: workload.clone(),
                })
            });
        }
        match controller_of(&object) {
            Some(("Deployment", d, u)) if matches!(workload, Workload::Deployment(_)) => {
                if d != name {
                    return Ok(Err(NotOwned::Deployment {
                        replicaset: owner,
                        deployment: d.to_owned(),
                        workload: workload.clone(),
                    }));
                }
                path = format!("{apps}/deployments/{d}");
                (owner, uid) = (d.to_owned(), u.to_owned());
            }
            _ => {
                return Ok(Err(NotOwned::Uncontrolled {
                    replicaset: owner,
                    workload: workload.clone(),
                }))
            }
        }
    }
}

/// One attempt: list the workload's pods on this node, choose, check, compare, write. The
/// node's kubeconfig is read afresh: a rotated client certificate is picked up at once.
pub async fn attempt(config: &WriterConfig, now: SystemTime) -> Result<Outcome, CheckpointError> {
    let api = ApiClient::from_kubeconfig(&config.kubeconfig)?;
    let path = format!(
        "/api/v1/namespaces/{}/pods?labelSelector={}&fieldSelector={}",
        config.namespace,
        encode(&config.selector),
        encode(&format!("spec.nodeName={}", config.node)),
    );
    let list = api
        .get_json(&path)
        .await
        .map_err(|source| CheckpointError::Api {
            path: path.clone(),
            source,
        })?;
    let items = list["items"].as_array().cloned().unwrap_or_default();
    let Some(pod) = choose(&items, now, config.after) else {
        return Ok(Outcome::NoCandidate);
    };
    let ours = Origin::of_pod(pod).map_err(|source| CheckpointError::Unusable {
        pod: "?".into(),
        source,
    })?;
    let file = config.dir.join(FILE);
    let existing = std::fs::read(&file).ok();
    let existing_value = existing
        .as_deref()
        .and_then(|b| serde_json::from_slice::<Value>(b).ok());
    let existing_origin = existing_value
        .as_ref()
        .and_then(|v| Origin::of_checkpoint(v).ok());
    let refused = |reason: String| {
        Ok(Outcome::Refused {
            pod: ours.pod.clone(),
            reason,
        })
    };
    if let Err(why) = replaces(existing_origin.as_ref(), &ours) {
        // Kept: it must still pass the rules of the boot (they may have changed since it was
        // written), or the reboot would find nothing to activate.
        if let Some(Err(e)) = existing_value
            .as_ref()
            .map(|v| staticpod::validate(v, &config.policy))
        {
            return refused(format!(
                "the checkpoint in {} would be refused at boot: {e}",
                config.dir.display()
            ));
        }
        return Ok(if existing_origin.is_some_and(|e| e.uid == ours.uid) {
            Outcome::Current
        } else {
            Outcome::Kept(why)
        });
    }
    if let Err(why) = owned_by(&api, &config.namespace, pod, &config.workload).await? {
        return refused(why.to_string());
    }
    let stamp = humantime::format_rfc3339_seconds(now).to_string();
    let checkpoint = match staticpod::from_pod(pod, &config.retire_file, &stamp) {
        Ok(c) => c,
        Err(e) => return refused(e.to_string()),
    };
    // The rules of the activation at boot, now, while there is an API to report to.
    if let Err(e) = staticpod::validate(&checkpoint, &config.policy) {
        return refused(format!("it would be refused at boot: {e}"));
    }
    let mut text = serde_json::to_vec_pretty(&checkpoint).expect("JSON value serializes");
    text.push(b'\n');
    store(&config.dir, existing.as_deref(), &text).map_err(|source| CheckpointError::File {
        path: config.dir.display().to_string(),
        source,
    })?;
    Ok(Outcome::Written(ours.pod))
}

/// When the checkpoint in `dir` was written (its annotation), if there is a readable one.
pub fn written_at(dir: &Path) -> Option<SystemTime> {
    let v: Value = serde_json::from_slice(&std::fs::read(dir.join(FILE)).ok()?).ok()?;
    humantime::parse_rfc3339(v["metadata"]["annotations"][staticpod::AT].as_str()?).ok()
}

/// Percent-encodes a query value.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Writes the checkpoint, the one it replaces kept as [`PREVIOUS`], both durably (the boot
/// reads them); removes temporary files an interrupted write left.
pub fn store(dir: &Path, existing: Option<&[u8]>, text: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".kube-apiserver") && name.ends_with(".tmp") {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    if let Some(old) = existing {
        write_durable(&dir.join(PREVIOUS), old, staticpod::MANIFEST_MODE)?;
    }
    write_durable(&dir.join(FILE), text, staticpod::MANIFEST_MODE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn origin(uid: &str, created: &str) -> Origin {
        Origin {
            pod: "kube-system/p".into(),
            uid: uid.into(),
            created: created.into(),
        }
    }

    #[test]
    fn an_older_pod_never_replaces_a_newer_checkpoint() {
        let old = origin("a", "2025-01-01T00:00:00Z");
        let new = origin("b", "2025-01-01T00:05:00Z");
        assert_eq!(replaces(None, &old), Ok(()));
        assert_eq!(replaces(Some(&old), &new), Ok(()));
        assert!(replaces(Some(&new), &old).is_err());
        assert!(replaces(Some(&new), &new).is_err());
    }

    fn pod(name: &str, created: &str, ready: Option<&str>) -> Value {
        let conditions = match ready {
            Some(t) => json!([{"type": "Ready", "status": "True", "lastTransitionTime": t}]),
            None => json!([{"type": "Ready", "status": "False", "lastTransitionTime": created}]),
        };
        json!({"metadata": {"name": name, "creationTimestamp": created},
               "status": {"conditions": conditions}})
    }

    #[test]
    fn the_newest_pod_ready_long_enough_is_chosen() {
        let now = humantime::parse_rfc3339("2025-01-01T01:00:00Z").unwrap();
        let after = Duration::from_secs(60);
        let good = pod("good", "2025-01-01T00:00:00Z", Some("2025-01-01T00:01:00Z"));
        // A broken rollout's pod: newer, never ready.
        let broken = pod("broken", "2025-01-01T00:50:00Z", None);
        // A new pod ready for 30 s only.
        let young = pod(
            "young",
            "2025-01-01T00:58:00Z",
            Some("2025-01-01T00:59:30Z"),
        );
        let pods = [good.clone(), broken.clone(), young.clone()];
        assert_eq!(
            choose(&pods, now, after).unwrap()["metadata"]["name"],
            "good"
        );
        // Once it has been ready for the wait, the new one is chosen.
        let later = now + Duration::from_secs(31);
        assert_eq!(
            choose(&pods, later, after).unwrap()["metadata"]["name"],
            "young"
        );
        // Mirror pods (kubeadm's static apiserver, the recovery instance) and pods being
        // deleted are never chosen.
        let mut mirror = pod(
            "mirror",
            "2025-01-01T00:59:00Z",
            Some("2025-01-01T00:00:00Z"),
        );
        mirror["metadata"]["annotations"] = json!({"kubernetes.io/config.mirror": "x"});
        let mut going = pod(
            "going",
            "2025-01-01T00:59:00Z",
            Some("2025-01-01T00:00:00Z"),
        );
        going["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:59:59Z");
        assert_eq!(
            choose(&[good, mirror, going, broken], now, after).unwrap()["metadata"]["name"],
            "good"
        );
        assert!(choose(&[pod("b", "2025-01-01T00:00:00Z", None)], now, after).is_none());
    }

    #[test]
    fn selectors_are_encoded() {
        assert_eq!(
            encode("component=kube-apiserver,tier=control-plane"),
            "component%3Dkube-apiserver%2Ctier%3Dcontrol-plane"
        );
    }

    #[test]
    fn store_keeps_the_previous_one_and_nothing_else() {
        let dir = std::env::temp_dir().join(format!("kap-store-{}", rand::random::<u64>()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(".kube-apiserver.json.1.tmp"), b"stale").unwrap();
        store(&dir, None, b"one").unwrap();
        store(&dir, Some(b"one"), b"two").unwrap();
        assert_eq!(std::fs::read(dir.join(FILE)).unwrap(), b"two");
        assert_eq!(std::fs::read(dir.join(PREVIOUS)).unwrap(), b"one");
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        assert_eq!(names, [FILE, PREVIOUS]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
