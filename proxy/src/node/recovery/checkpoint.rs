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
use k8s_openapi::api::apps::v1::{DaemonSet, ReplicaSet};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

use crate::base::fsutil::write_durable;
use crate::node::api::{ApiClient, ApiError};
use crate::node::kubeconfig::KubeconfigError;
use crate::node::object::{self, Deployment, ObjectError, ObjectMeta, Pod};
use crate::node::recovery::staticpod::{self, Origin};

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
pub fn ready_since(pod: &Pod) -> Option<SystemTime> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready" && c.status == "True")
        .and_then(|c| c.last_transition_time.as_ref())
        .and_then(|t| {
            let since_epoch = Duration::try_from(t.0.as_duration()).ok()?;
            SystemTime::UNIX_EPOCH.checked_add(since_epoch)
        })
}

/// The pod to checkpoint among `pods` (a pod list's items) at `now`: not a mirror pod, not
/// being deleted, Ready without a break for `after`; the newest such by `creationTimestamp`.
pub fn choose(pods: &[Pod], now: SystemTime, after: Duration) -> Option<&Pod> {
    pods.iter()
        .filter(|p| {
            let meta = &p.metadata;
            object::annotation(meta, object::MIRROR_OF).is_none()
                && meta.deletion_timestamp.is_none()
                && ready_since(p).is_some_and(|t| now.duration_since(t).is_ok_and(|d| d >= after))
        })
        .max_by(|a, b| {
            a.metadata
                .creation_timestamp
                .cmp(&b.metadata.creation_timestamp)
        })
}

/// The controller owner reference of an object (of its `metadata`), if it has one.
pub fn controller_of(meta: &ObjectMeta) -> Option<&OwnerReference> {
    meta.owner_references
        .as_ref()?
        .iter()
        .find(|r| r.controller == Some(true))
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

/// The metadata of the `K` that `reference` names in `namespace`, read from the API, if it is the
/// one named (its uid): `Ok(Err(why))` when it is missing or another.
///
/// Only the metadata is used and nothing is written back: the object is read as the API gives
/// it (a field this build does not know is ignored, not refused).
async fn owner_meta<K>(
    api: &ApiClient,
    namespace: &str,
    reference: &OwnerReference,
) -> Result<Result<ObjectMeta, NotOwned>, CheckpointError>
where
    K: k8s_openapi::Resource + k8s_openapi::Metadata<Ty = ObjectMeta> + DeserializeOwned,
{
    let path = object::path::<K>(namespace, &reference.name);
    let meta = match api.get_as::<K>(&path).await {
        Ok(o) => o.metadata().clone(),
        Err(e) if e.status() == Some(StatusCode::NOT_FOUND) => {
            return Ok(Err(NotOwned::Missing(path)))
        }
        Err(source) => return Err(CheckpointError::Api { path, source }),
    };
    if meta.uid.as_deref() != Some(reference.uid.as_str()) {
        return Ok(Err(NotOwned::Uid {
            path,
            uid: reference.uid.clone(),
        }));
    }
    Ok(Ok(meta))
}

/// Follows `pod`'s controller owner references up to `workload`, reading each owner from the
/// API and comparing uids: `Ok(Err(why))` when the chain does not lead there.
async fn owned_by(
    api: &ApiClient,
    namespace: &str,
    pod: &Pod,
    workload: &Workload,
) -> Result<Result<(), NotOwned>, CheckpointError> {
    let (want, name) = match workload {
        Workload::Deployment(n) => ("ReplicaSet", n),
        Workload::DaemonSet(n) => ("DaemonSet", n),
    };
    let Some(reference) = controller_of(&pod.metadata) else {
        return Ok(Err(NotOwned::NoController(workload.clone())));
    };
    if reference.kind != want {
        return Ok(Err(NotOwned::Kind {
            kind: reference.kind.clone(),
            owner: reference.name.clone(),
            want,
            workload: workload.clone(),
        }));
    }
    match workload {
        Workload::DaemonSet(_) => {
            if let Err(why) = owner_meta::<DaemonSet>(api, namespace, reference).await? {
                return Ok(Err(why));
            }
            Ok(if reference.name == *name {
                Ok(())
            } else {
                Err(NotOwned::Owner {
                    owner: reference.name.clone(),
                    workload: workload.clone(),
                })
            })
        }
        Workload::Deployment(_) => {
            let replicaset = match owner_meta::<ReplicaSet>(api, namespace, reference).await? {
                Ok(meta) => meta,
                Err(why) => return Ok(Err(why)),
            };
            let deployment = match controller_of(&replicaset) {
                Some(d) if d.kind == "Deployment" => d,
                _ => {
                    return Ok(Err(NotOwned::Uncontrolled {
                        replicaset: reference.name.clone(),
                        workload: workload.clone(),
                    }))
                }
            };
            if deployment.name != *name {
                return Ok(Err(NotOwned::Deployment {
                    replicaset: reference.name.clone(),
                    deployment: deployment.name.clone(),
                    workload: workload.clone(),
                }));
            }
            Ok(owner_meta::<Deployment>(api, namespace, deployment)
                .await?
                .map(drop))
        }
    }
}

/// A pod list as the API returns it, its items kept as JSON: the one written is read again
/// with nothing lost ([`object::from_value`]).
#[derive(Deserialize)]
struct PodList {
    #[serde(default)]
    items: Option<Vec<Value>>,
}

/// The metadata of a checkpoint file (its origin, when it was written): nothing else of it is
/// read here, so a file this build would refuse to activate ([`staticpod::read`]) still says
/// whose it is.
fn file_metadata(bytes: &[u8]) -> Option<ObjectMeta> {
    #[derive(Deserialize)]
    struct File {
        #[serde(default)]
        metadata: ObjectMeta,
    }
    serde_json::from_slice::<File>(bytes)
        .ok()
        .map(|f| f.metadata)
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
    let api_error = |source| CheckpointError::Api {
        path: path.clone(),
        source,
    };
    let items = api
        .get_as::<PodList>(&path)
        .await
        .map_err(api_error)?
        .items
        .unwrap_or_default();
    let pods = items
        .iter()
        .map(Pod::deserialize)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            api_error(ApiError::Object(ObjectError::Shape {
                kind: "Pod",
                message: e.to_string(),
            }))
        })?;
    let Some(pod) = choose(&pods, now, config.after) else {
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
    let existing_origin = existing
        .as_deref()
        .and_then(file_metadata)
        .and_then(|metadata| {
            Origin::of_checkpoint(&Pod {
                metadata,
                ..Pod::default()
            })
            .ok()
        });
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
            .map(|v| staticpod::read(v).and_then(|p| staticpod::validate(&p, &config.policy)))
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
    let raw = &items[pods
        .iter()
        .position(|p| std::ptr::eq(p, pod))
        .expect("chosen among them")];
    let text = match checkpoint_file(raw, config, now) {
        Ok(text) => text,
        Err(reason) => return refused(reason.to_string()),
    };
    store(&config.dir, existing.as_deref(), &text).map_err(|source| CheckpointError::File {
        path: config.dir.display().to_string(),
        source,
    })?;
    Ok(Outcome::Written(ours.pod))
}

/// Why the chosen pod makes no checkpoint file (the reason of [`Outcome::Refused`]).
#[derive(Debug, thiserror::Error)]
enum FileRefusal {
    /// A field this build does not know: its checkpoint would run without it, not as the pod
    /// that was ready.
    #[error("{0}; no checkpoint is written without it")]
    Unknown(#[source] ObjectError),
    #[error(transparent)]
    Unusable(staticpod::Unusable),
    #[error("it would be refused at boot: {0}")]
    AtBoot(#[source] staticpod::Unusable),
}

/// The checkpoint file's text made of `pod`, the very pod chosen as the API gave it, at `now`;
/// or why it is refused.
fn checkpoint_file(
    pod: &Value,
    config: &WriterConfig,
    now: SystemTime,
) -> Result<Vec<u8>, FileRefusal> {
    let pod: Pod = object::from_value(pod.clone()).map_err(FileRefusal::Unknown)?;
    let stamp = humantime::format_rfc3339_seconds(now).to_string();
    let checkpoint =
        staticpod::from_pod(&pod, &config.retire_file, &stamp).map_err(FileRefusal::Unusable)?;
    // The rules of the activation at boot, now, while there is an API to report to.
    staticpod::validate(&checkpoint, &config.policy).map_err(FileRefusal::AtBoot)?;
    // Through a JSON value: its keys sorted, as every checkpoint before.
    let mut text =
        serde_json::to_vec_pretty(&object::to_value(&checkpoint)).expect("JSON value serializes");
    text.push(b'\n');
    Ok(text)
}

/// When the checkpoint in `dir` was written (its annotation), if there is a readable one.
pub fn written_at(dir: &Path) -> Option<SystemTime> {
    let metadata = file_metadata(&std::fs::read(dir.join(FILE)).ok()?)?;
    humantime::parse_rfc3339(metadata.annotations?.get(staticpod::AT)?).ok()
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
        write_durable(
            &dir.join(PREVIOUS),
            old,
            crate::node::manifest::MANIFEST_MODE,
        )?;
    }
    write_durable(&dir.join(FILE), text, crate::node::manifest::MANIFEST_MODE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
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

    fn pod(name: &str, created: &str, ready: Option<&str>) -> Pod {
        let conditions = match ready {
            Some(t) => json!([{"type": "Ready", "status": "True", "lastTransitionTime": t}]),
            None => json!([{"type": "Ready", "status": "False", "lastTransitionTime": created}]),
        };
        object::from_value(
            json!({"metadata": {"name": name, "creationTimestamp": created},
                                  "status": {"conditions": conditions}}),
        )
        .unwrap()
    }

    fn name(pod: Option<&Pod>) -> &str {
        pod.unwrap().metadata.name.as_deref().unwrap()
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
        assert_eq!(name(choose(&pods, now, after)), "good");
        // Once it has been ready for the wait, the new one is chosen.
        let later = now + Duration::from_secs(31);
        assert_eq!(name(choose(&pods, later, after)), "young");
        // Mirror pods (kubeadm's static apiserver, the recovery instance) and pods being
        // deleted are never chosen.
        let mut mirror = pod(
            "mirror",
            "2025-01-01T00:59:00Z",
            Some("2025-01-01T00:00:00Z"),
        );
        mirror.metadata.annotations =
            Some([("kubernetes.io/config.mirror".to_owned(), "x".to_owned())].into());
        let mut going = pod(
            "going",
            "2025-01-01T00:59:00Z",
            Some("2025-01-01T00:00:00Z"),
        );
        going.metadata.deletion_timestamp = Some(Time("2025-01-01T00:59:59Z".parse().unwrap()));
        assert_eq!(
            name(choose(&[good, mirror, going, broken], now, after)),
            "good"
        );
        assert!(choose(&[pod("b", "2025-01-01T00:00:00Z", None)], now, after).is_none());
    }

    /// The chosen pod as the API gave it becomes the file; one from a newer API, with a field
    /// this build does not know, is refused with the field's path and no file is made.
    #[test]
    fn a_pod_with_a_field_this_build_does_not_know_is_not_written() {
        let config = WriterConfig {
            dir: PathBuf::from("/var/lib/kube-apiserver-proxy/checkpoint"),
            namespace: "kube-system".into(),
            selector: "component=kube-apiserver".into(),
            workload: Workload::Deployment("kube-apiserver".into()),
            node: "node-1".into(),
            after: Duration::from_secs(60),
            retire_file: "/run/kube-apiserver-proxy/checkpoint-retire".into(),
            kubeconfig: PathBuf::from("/etc/kubernetes/kubelet.conf"),
            policy: staticpod::tests::policy(),
        };
        let now = humantime::parse_rfc3339("2025-01-02T04:00:00Z").unwrap();
        let raw = staticpod::tests::pod_json();
        let text = checkpoint_file(&raw, &config, now).unwrap();
        assert!(text.ends_with(b"}\n"));
        let file = staticpod::read(serde_json::from_slice(&text).unwrap()).unwrap();
        assert_eq!(
            staticpod::validate(&file, &config.policy).unwrap().pod,
            "kube-system/kube-apiserver-7d4f9c-abcde"
        );
        assert_eq!(
            file.metadata.annotations.unwrap()[staticpod::AT],
            "2025-01-02T04:00:00Z"
        );

        let mut newer = raw;
        newer["spec"]["containers"][1]["lifecycle"]["preStop"]["sleep"]["jitter"] = json!("1s");
        let why = checkpoint_file(&newer, &config, now).unwrap_err();
        assert_eq!(
            why.to_string(),
            "Pod has a field this build does not know (spec.containers[1].lifecycle.preStop.sleep.jitter; \
             it knows Kubernetes v1.37): it would be lost; no checkpoint is written without it"
        );
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
