//! The leader election lease of a controller pod whose copy `kubeadm-sync` replaces or removes
//! (kube-controller-manager, kube-scheduler: kubeadm's upgrade, `kubeadm certs renew` and the
//! restart its docs ask for).
//!
//! Written in place, a new copy gets a new UID: the kubelet stops the old pod and starts the new
//! one at the same time. The old process exits on SIGTERM without releasing its lease
//! (kube-controller-manager releases it only behind an alpha gate), and the new one, once up,
//! must see the lease unrenewed for its whole duration (15 s) from its own first look before it
//! takes it: measured on the rehearsal's node, 32 s without a controller-manager leader in a
//! minor upgrade. So for these pods the copy is removed first; once the kubelet has deleted the
//! old mirror pod (it does so only after the pod's containers have stopped,
//! `pkg/kubelet/kubelet_pods.go` `deleteOrphanedMirrorPods`), the lease, if this node's process
//! still holds it, is released as client-go releases its own (`holderIdentity` empty,
//! `leaseDurationSeconds: 1`; a conditional update on its `resourceVersion`); then, after
//! [`KUBELET_FINISH`], the new copy is written and its process takes the lease at its first try.
//! The kubelet deletes the mirror pod before its pod worker has finished the old pod
//! (`pkg/kubelet/pod_workers.go`): a static pod of the same name that arrives meanwhile is held
//! back (`allowStaticPodStart`) and tried again only after the worker's back-off, 10–15 s
//! (measured once: the new controller-manager started 13.4 s after its copy, 16.4 s without a
//! leader); the old pod's last sync follows the mirror pod's deletion within a second. The old process is known gone
//! and the new one not started, so no two leaders can overlap. Without an answer from the
//! apiserver, or when the old mirror pod is still there after [`STOP_WAIT`], the lease is left
//! to expire (as before).

use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;

use crate::node::api::ApiClient;
use crate::node::object::{self, Lease, Pod};

/// The copies whose pod elects a leader with a lease.
pub const LEADERS: [&str; 2] = ["kube-controller-manager.yaml", "kube-scheduler.yaml"];

/// How long the kubelet is given, after deleting the old mirror pod, to finish the old pod
/// before a new one of the same name arrives (module documentation).
pub const KUBELET_FINISH: Duration = Duration::from_secs(3);

/// How long the old pod may take to stop (the kubelet's look at the directory, the pod's
/// grace period: kubeadm sets none, 30 s, and both exit at once on SIGTERM).
pub const STOP_WAIT: Duration = Duration::from_secs(45);

/// The lease `pod` elects its leader with, as its flags say: `(namespace, name)`,
/// `kube-system/<its container's name>` by default; none with `--leader-elect=false` or a lock
/// other than leases.
pub fn lease_of(pod: &Pod) -> Option<(String, String)> {
    let c = pod.spec.as_ref()?.containers.first()?;
    let container = c.name.as_str();
    let words: Vec<&str> = [&c.command, &c.args]
        .into_iter()
        .flatten()
        .flatten()
        .map(String::as_str)
        .collect();
    let flag = |name: &str| {
        words
            .iter()
            .find_map(|w| w.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
    };
    if flag("--leader-elect") == Some("false")
        || flag("--leader-elect-resource-lock").is_some_and(|l| l != "leases")
    {
        return None;
    }
    Some((
        flag("--leader-elect-resource-namespace")
            .unwrap_or("kube-system")
            .to_owned(),
        flag("--leader-elect-resource-name")
            .unwrap_or(container)
            .to_owned(),
    ))
}

/// `lease` released, as client-go releases its own, when a process of this host holds it (its
/// identity is `<hostname>_<uuid>`); none otherwise (released already, or another's).
pub fn released(lease: &Lease, hosts: &[&str], now: SystemTime) -> Option<Lease> {
    let holder = holder(lease);
    if !hosts
        .iter()
        .any(|h| !h.is_empty() && holder.starts_with(&format!("{h}_")))
    {
        return None;
    }
    // Written in microseconds (MicroTime), as client-go writes them.
    let micros = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros();
    let at = i64::try_from(micros)
        .ok()
        .and_then(|m| k8s_openapi::jiff::Timestamp::from_microsecond(m).ok())
        .map(MicroTime);
    let mut l = lease.clone();
    let spec = l.spec.get_or_insert_with(Default::default);
    spec.holder_identity = Some(String::new());
    spec.lease_duration_seconds = Some(1);
    spec.acquire_time = at.clone();
    spec.renew_time = at;
    Some(l)
}

/// Who holds `lease` (empty: nobody).
fn holder(lease: &Lease) -> &str {
    lease
        .spec
        .as_ref()
        .and_then(|s| s.holder_identity.as_deref())
        .unwrap_or("")
}

/// What became of the lease.
#[derive(Debug, PartialEq, Eq)]
pub enum Handover {
    /// Released: the holder it had.
    Released(String),
    /// Not held by this node's process (released at its exit, or another's).
    NotHeld,
    /// The old pod not seen gone within [`STOP_WAIT`]: left to expire.
    StillRunning,
}

/// Why a lease could not be released.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct HandoverError {
    path: String,
    #[source]
    source: crate::node::api::ApiError,
}

/// Waits until the mirror pod `path` of the pod `uid` is gone and [`KUBELET_FINISH`] more, then
/// releases `lease`. `api` is asked for a client until it gives one, which then serves to the
/// end.
pub async fn after_stop(
    api: impl Fn() -> Option<ApiClient>,
    mirror_path: &str,
    uid: &str,
    (namespace, name): (&str, &str),
    hosts: &[&str],
) -> Result<Handover, HandoverError> {
    let started = Instant::now();
    let mut client = None;
    let api = loop {
        if client.is_none() {
            client = api();
        }
        if let Some(api) = &client {
            // Only looked at: read as far as this build knows pods.
            match api.get_as::<Pod>(mirror_path).await {
                Err(e) if e.status() == Some(hyper::StatusCode::NOT_FOUND) => break api,
                Ok(m) if object::annotation(&m.metadata, object::MIRROR_OF) != Some(uid) => {
                    break api
                }
                _ => {}
            }
        }
        if started.elapsed() > STOP_WAIT {
            return Ok(Handover::StillRunning);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // The mirror pod gone, the kubelet still finishes the old pod: a successor of the same name
    // written before that is held back for its pod worker's back-off (10–15 s).
    tokio::time::sleep(KUBELET_FINISH).await;
    let path = object::path::<Lease>(namespace, name);
    // Refused when a field of it would be lost: it is written back.
    let lease: Lease = api
        .get_object(&path)
        .await
        .map_err(|source| HandoverError {
            path: path.clone(),
            source,
        })?;
    let Some(free) = released(&lease, hosts, SystemTime::now()) else {
        return Ok(Handover::NotHeld);
    };
    // With the resourceVersion read: refused (409) if anyone wrote it meanwhile.
    api.send_object("PUT", &path, &free)
        .await
        .map_err(|source| HandoverError { path, source })?;
    Ok(Handover::Released(holder(&lease).to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(args: &[&str]) -> Pod {
        object::from_value(json!({"apiVersion": "v1", "kind": "Pod",
            "spec": {"containers": [{"name": "kube-controller-manager", "command": args}]}}))
        .unwrap()
    }

    #[test]
    fn the_lease_is_the_one_its_flags_name() {
        assert_eq!(
            lease_of(&pod(&["kube-controller-manager", "--leader-elect=true"])),
            Some(("kube-system".into(), "kube-controller-manager".into()))
        );
        assert_eq!(
            lease_of(&pod(&[
                "kube-controller-manager",
                "--leader-elect-resource-name=cm",
                "--leader-elect-resource-namespace=ops"
            ])),
            Some(("ops".into(), "cm".into()))
        );
        assert_eq!(
            lease_of(&pod(&["kube-controller-manager", "--leader-elect=false"])),
            None
        );
        assert_eq!(
            lease_of(&pod(&[
                "kube-controller-manager",
                "--leader-elect-resource-lock=endpoints"
            ])),
            None
        );
    }

    #[test]
    fn only_this_hosts_holder_is_released_as_client_go_releases() {
        let lease: Lease = object::from_value(json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"resourceVersion": "7"},
            "spec": {"holderIdentity": "node-1_0b7e", "leaseDurationSeconds": 15, "leaseTransitions": 3}}))
        .unwrap();
        let now = SystemTime::UNIX_EPOCH + Duration::from_nanos(1_800_000_000_000_000_999);
        let free = released(&lease, &["node-1"], now).unwrap();
        let spec = free.spec.as_ref().unwrap();
        assert_eq!(spec.holder_identity.as_deref(), Some(""));
        assert_eq!(spec.lease_duration_seconds, Some(1));
        assert_eq!(spec.lease_transitions, Some(3));
        assert_eq!(free.metadata.resource_version.as_deref(), Some("7"));
        assert_eq!(
            object::to_value(&free)["spec"]["renewTime"],
            "2027-01-15T08:00:00.000000Z"
        );
        assert_eq!(spec.acquire_time, spec.renew_time);
        assert_eq!(released(&lease, &["node-10", ""], now), None);
        assert_eq!(released(&free, &["node-1"], now), None);
    }
}
