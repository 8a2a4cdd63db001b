//! `kube-apiserver-proxy kubeadm-sync --undo`: the last step of going back from `kubeadm-sync`
//! to kubeadm's own layout (docs/runbooks/going-back.md), once `migrate-back` has put kubeadm's
//! apiserver into the kubelet's directory and the Deployment is gone.
//!
//! The kubelet still runs `--static-pod-dir` (its `--pod-manifest-path`): the copies of etcd,
//! the controller-manager and the scheduler, and kubeadm's apiserver. Restarted on kubeadm's
//! directory it would read kubeadm's files, and the kubelet derives a static pod's UID from the
//! file's path when the file carries none (`pkg/kubelet/config/common.go`, `applyDefaults`):
//! every static pod would get a new UID, and the kubelet would replace each one (etcd's
//! replacement waits on the API while etcd itself is down). So this writes into kubeadm's
//! directory, for each file the kubelet runs, exactly that file: the same pod with the UID it
//! runs under (every copy carries one, and so does the manifest `migrate-back` installs).
//! Restarted on kubeadm's directory, the kubelet finds the pods it runs: nothing restarts.
//!
//! It refuses (exit 2, nothing written) when the kubelet's directory holds anything that is not
//! one of kubeadm's pods as kubeadm has it: the agent's stand-in (it still runs), reboot
//! recovery's agent or a checkpoint, a copy kubeadm has changed since (the agent has not
//! caught up, or held back a change whose canary failed), a file without a UID, or no apiserver
//! (`migrate-back` not done). kubeadm's apiserver is taken as `migrate-back` installed it (the
//! manifest rendered by kubeadm, with `--permit-port-sharing=true`).
//!
//! kubeadm's files then carry `metadata.uid`. kubeadm's next `upgrade apply` writes each pod
//! it upgrades without one (a new pod, as on any kubeadm node), and a pod it does not upgrade
//! but finds different from what it renders is written again too: each at most once.

use std::path::Path;

use crate::base::fsutil::write_durable;
use crate::node::kubeadm::sync::{self, SyncError, APISERVER};
use crate::node::manifest::MANIFEST_MODE;

/// Why a file of the kubelet's directory cannot be handed to kubeadm's.
fn refuse(path: &Path, why: impl Into<String>) -> SyncError {
    SyncError::Undo {
        path: path.display().to_string(),
        why: why.into(),
    }
}

/// What `undo` writes: each of the kubelet's files, by name, with its bytes and its UID.
#[derive(Debug)]
pub struct Handover {
    pub name: String,
    pub uid: String,
    bytes: Vec<u8>,
}

/// Checks the two directories and returns what goes into kubeadm's (nothing is written).
pub fn plan(kubeadm_dir: &Path, static_pod_dir: &Path) -> Result<Vec<Handover>, SyncError> {
    if kubeadm_dir == static_pod_dir {
        return Err(SyncError::SameDir);
    }
    let running = sync::manifests(static_pod_dir)?;
    let kubeadms = sync::manifests(kubeadm_dir)?;
    if !running.contains(APISERVER) {
        return Err(refuse(
            &static_pod_dir.join(APISERVER),
            "not there: no apiserver runs from the kubelet's directory; run migrate-back with --static-pod-dir on it first",
        ));
    }
    let mut out = Vec::new();
    for name in &running {
        let path = static_pod_dir.join(name);
        let pod = sync::read_pod(&path).map_err(|e| refuse(&path, e.to_string()))?;
        let pod = pod.pod();
        if sync::digests(&pod.metadata).0.is_some() {
            return Err(refuse(&path, "the kubeadm-sync stand-in still runs: move it out of the kubelet's directory first (the kubelet stops the agent), then migrate-back"));
        }
        if !kubeadms.contains(name) {
            return Err(refuse(&path, format!(
                "kubeadm has no {name} in {}: not one of kubeadm's static pods (reboot recovery's agent, a checkpoint?); move it out of the kubelet's directory first",
                kubeadm_dir.display()
            )));
        }
        let Some(uid) = pod.metadata.uid.as_deref().filter(|u| !u.is_empty()) else {
            return Err(refuse(&path, "carries no metadata.uid: the UID the kubelet runs it under cannot be carried over, and a pod read from another file without one gets a new UID (a restart)"));
        };
        if name != APISERVER {
            let theirs = kubeadm_dir.join(name);
            let kubeadms_pod = sync::read_pod(&theirs)?;
            if !sync::same_pod(kubeadms_pod.pod(), pod) {
                return Err(refuse(&theirs, format!(
                    "kubeadm's pod is not the one that runs from {}: kubeadm changed it and the agent has not followed (a change still under way, or one whose etcd canary failed: see the agent's log); bring them in line first",
                    path.display()
                )));
            }
        }
        let bytes = std::fs::read(&path).map_err(|e| refuse(&path, e.to_string()))?;
        out.push(Handover {
            name: name.clone(),
            uid: uid.to_owned(),
            bytes,
        });
    }
    // A pod of kubeadm's the kubelet does not run now would start at the switch.
    if let Some(extra) = kubeadms.difference(&running).next() {
        return Err(refuse(&kubeadm_dir.join(extra), format!(
            "the kubelet does not run it from {}: restarted on kubeadm's directory it would start it; move it out of kubeadm's directory or let kubeadm-sync copy it first",
            static_pod_dir.display()
        )));
    }
    Ok(out)
}

/// `kubeadm-sync --undo`: [`plan`], then each file written into kubeadm's directory, durably,
/// with kubeadm's mode.
pub fn undo(kubeadm_dir: &Path, static_pod_dir: &Path) -> Result<Vec<Handover>, SyncError> {
    let handed = plan(kubeadm_dir, static_pod_dir)?;
    for h in &handed {
        let dst = kubeadm_dir.join(&h.name);
        write_durable(&dst, &h.bytes, MANIFEST_MODE).map_err(|source| SyncError::Io {
            what: "write",
            path: dst.display().to_string(),
            source,
        })?;
        tracing::info!(manifest = %dst.display(), uid = %h.uid, "kubeadm-sync --undo: kubeadm's manifest is the pod the kubelet runs, with its UID");
    }
    tracing::info!(
        kubeadm_dir = %kubeadm_dir.display(),
        "kubeadm-sync --undo: done: restart the kubelet with --pod-manifest-path={} (take --pod-manifest-path={} out of KUBELET_EXTRA_ARGS): it keeps every static pod running",
        kubeadm_dir.display(),
        static_pod_dir.display()
    );
    Ok(handed)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ETCD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: etcd\n  namespace: kube-system\nspec:\n  containers:\n  - name: etcd\n    image: registry.k8s.io/etcd:3.6.16-0\n    command: [etcd]\n";
    const APISERVER_POD: &str = "apiVersion: v1\nkind: Pod\nmetadata:\n  name: kube-apiserver\n  namespace: kube-system\n  uid: 0f0f\nspec:\n  containers:\n  - name: kube-apiserver\n    image: registry.k8s.io/kube-apiserver:v1.37.2\n    command: [kube-apiserver, --permit-port-sharing=true]\n";

    fn with_uid(pod: &str, uid: &str) -> String {
        pod.replacen(
            "  name: etcd\n",
            &format!("  name: etcd\n  uid: {uid}\n"),
            1,
        )
    }

    struct Dirs {
        tmp: std::path::PathBuf,
        kubeadm: std::path::PathBuf,
        kubelet: std::path::PathBuf,
    }

    impl Drop for Dirs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.tmp);
        }
    }

    fn dirs(kubeadm: &[(&str, &str)], kubelet: &[(&str, &str)]) -> Dirs {
        let tmp = std::env::temp_dir().join(format!("kap-undo-{}", rand::random::<u64>()));
        let (a, b) = (tmp.join("manifests"), tmp.join("kubelet"));
        for (dir, files) in [(&a, kubeadm), (&b, kubelet)] {
            std::fs::create_dir_all(dir).unwrap();
            for (name, text) in files {
                std::fs::write(dir.join(name), text).unwrap();
            }
        }
        Dirs {
            tmp,
            kubeadm: a,
            kubelet: b,
        }
    }

    fn refused(d: &Dirs) -> String {
        match plan(&d.kubeadm, &d.kubelet) {
            Err(e @ SyncError::Undo { .. }) => {
                assert!(crate::base::exit::CommandError::is_bad_input(&e));
                e.to_string()
            }
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn kubeadms_files_become_what_the_kubelet_runs_with_its_uids() {
        let copy = with_uid(ETCD, "abc123");
        let d = dirs(
            &[("etcd.yaml", ETCD), ("kube-apiserver.yaml", "kubeadm's")],
            &[("etcd.yaml", &copy), ("kube-apiserver.yaml", APISERVER_POD)],
        );
        let handed = undo(&d.kubeadm, &d.kubelet).unwrap();
        let uids: Vec<_> = handed
            .iter()
            .map(|h| (h.name.as_str(), h.uid.as_str()))
            .collect();
        assert_eq!(
            uids,
            [("etcd.yaml", "abc123"), ("kube-apiserver.yaml", "0f0f")]
        );
        for name in ["etcd.yaml", "kube-apiserver.yaml"] {
            assert_eq!(
                std::fs::read(d.kubeadm.join(name)).unwrap(),
                std::fs::read(d.kubelet.join(name)).unwrap(),
                "{name}"
            );
        }
    }

    #[test]
    fn what_is_not_kubeadms_pod_as_kubeadm_has_it_is_refused() {
        let copy = with_uid(ETCD, "abc123");
        // No apiserver: migrate-back not done.
        assert!(
            refused(&dirs(&[("etcd.yaml", ETCD)], &[("etcd.yaml", &copy)]))
                .contains("migrate-back")
        );
        // The stand-in still there.
        let standin = APISERVER_POD.replacen(
            "  uid: 0f0f\n",
            &format!(
                "  uid: 0f0f\n  annotations:\n    {}: x\n",
                crate::node::kubeadm::render::MANIFEST_DIGEST
            ),
            1,
        );
        assert!(refused(&dirs(
            &[("kube-apiserver.yaml", "k")],
            &[("kube-apiserver.yaml", &standin)]
        ))
        .contains("stand-in"));
        // Recovery's agent.
        assert!(refused(&dirs(
            &[("kube-apiserver.yaml", "k")],
            &[
                ("kube-apiserver.yaml", APISERVER_POD),
                ("kube-apiserver-recovery.yaml", &copy)
            ]
        ))
        .contains("kubeadm has no kube-apiserver-recovery.yaml"));
        // No UID.
        assert!(refused(&dirs(
            &[("etcd.yaml", ETCD), ("kube-apiserver.yaml", "k")],
            &[("etcd.yaml", ETCD), ("kube-apiserver.yaml", APISERVER_POD)]
        ))
        .contains("no metadata.uid"));
        // kubeadm changed etcd and the copy has not followed.
        let newer = ETCD.replace("3.6.16-0", "3.7.0-0");
        assert!(refused(&dirs(
            &[("etcd.yaml", &newer), ("kube-apiserver.yaml", "k")],
            &[("etcd.yaml", &copy), ("kube-apiserver.yaml", APISERVER_POD)]
        ))
        .contains("has not followed"));
        // kubeadm has a pod the kubelet does not run.
        let d = dirs(
            &[("etcd.yaml", ETCD), ("kube-apiserver.yaml", "k")],
            &[("kube-apiserver.yaml", APISERVER_POD)],
        );
        assert!(refused(&d).contains("would start it"));
        // Nothing written by a refusal.
        assert_eq!(
            std::fs::read_to_string(d.kubeadm.join("kube-apiserver.yaml")).unwrap(),
            "k"
        );
    }
}
