//! Static pod files as the node agents write them, shared by the jobs that write them
//! (`kubeadm-sync` and its `--undo`, `migrate-back`, the recovery checkpoint): the file's mode
//! ([`MANIFEST_MODE`]), the file read and edited without losing a byte of what the agent does
//! not edit ([`Manifest`]), and the UID it carries ([`static_uid`]).

use std::collections::BTreeMap;

use serde_json::Value;

use crate::node::object::{self, ObjectError, Pod};

/// The mode of every static pod manifest and checkpoint written here: kubeadm's
/// (`WriteStaticPodToDisk` in `cmd/kubeadm/app/util/staticpod`). Only root reads them: the
/// kubelet, `kubeadm`, and `recover` (root, `CAP_DAC_OVERRIDE`).
pub const MANIFEST_MODE: u32 = 0o600;

/// This host's name (its UTS namespace's; empty when unreadable): what controllers put
/// before `_` in their lease identity, and a salt of [`static_uid`].
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .unwrap_or_default()
}

/// A static pod's file as this agent reads, compares and writes it: the pod, typed (read with
/// [`object::from_value`]: a field this build does not know is refused, named by its path),
/// and the document as read.
///
/// Every look and every edit is on the typed pod; what is written and hashed ([`static_uid`])
/// is the document as read with the agent's edits written into it (`Manifest::edit`), never
/// the typed pod serialized anew. kubeadm writes `metadata.creationTimestamp: null`, which a
/// typed pod drops (and a timestamp would come back in another format): a copy written from
/// the typed pod would differ from the one an earlier release of this agent wrote for the same
/// kubeadm file, and so would its UID, and the kubelet would restart every static pod, etcd's
/// included, at the agent's upgrade.
#[derive(Debug, Clone, PartialEq)]
pub struct Manifest {
    pod: Pod,
    doc: Value,
}

impl Manifest {
    /// The static pod `doc` (a YAML or JSON document as read).
    pub fn from_value(doc: Value) -> Result<Self, ObjectError> {
        Ok(Manifest {
            pod: object::from_value(doc.clone())?,
            doc,
        })
    }

    /// The pod.
    pub fn pod(&self) -> &Pod {
        &self.pod
    }

    /// The document: as read, with the agent's edits.
    pub fn document(&self) -> &Value {
        &self.doc
    }

    /// The file's text.
    pub fn to_yaml(&self) -> String {
        crate::base::yaml::to_yaml(&self.doc)
    }

    /// Makes `edit` on the pod and writes it into the document. Only the fields this agent
    /// edits are written (`metadata.uid`, `metadata.annotations`,
    /// `spec.terminationGracePeriodSeconds`), each only where it changed: the rest of the
    /// document stays as read.
    pub fn edit(&mut self, edit: impl FnOnce(&mut Pod)) {
        edit(&mut self.pod);
        let meta = &self.pod.metadata;
        let grace = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.termination_grace_period_seconds);
        write_field(
            &mut self.doc,
            &["metadata", "uid"],
            meta.uid.as_ref().map(object::to_value),
        );
        write_field(
            &mut self.doc,
            &["metadata", "annotations"],
            meta.annotations.as_ref().map(object::to_value),
        );
        write_field(
            &mut self.doc,
            &["spec", "terminationGracePeriodSeconds"],
            grace.map(Value::from),
        );
        debug_assert_eq!(
            object::from_value::<Pod>(self.doc.clone()).as_ref(),
            Ok(&self.pod),
            "an edit of a field the document does not get"
        );
    }

    /// The file as kubeadm wrote it ([`as_kubeadms`]).
    pub fn as_kubeadms(&self) -> Manifest {
        let mut m = self.clone();
        m.edit(strip_agents);
        m
    }

    /// This file's UID on `node` as `name` ([`static_uid`]).
    pub fn static_uid(&self, node: &str, name: &str) -> String {
        uid_of(node, name, &self.as_kubeadms().to_yaml())
    }
}

/// Sets the field at `path` of `doc` to `value` (`None`: takes it out), unless it holds that
/// already (a null stands for none: left as it is). [`Manifest::edit`]'s, for the document as
/// read.
fn write_field(doc: &mut Value, path: &[&str], value: Option<Value>) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let have = parents
        .iter()
        .try_fold(&*doc, |v, key| v.get(key))
        .and_then(|v| v.get(last))
        .filter(|v| !v.is_null());
    if have == value.as_ref() {
        return;
    }
    let mut at = doc;
    for key in parents {
        if at.is_null() {
            *at = Value::Object(Default::default());
        }
        let Some(object) = at.as_object_mut() else {
            return;
        };
        at = object
            .entry(*key)
            .or_insert_with(|| Value::Object(Default::default()));
    }
    if at.is_null() {
        *at = Value::Object(Default::default());
    }
    if let Some(object) = at.as_object_mut() {
        match value {
            Some(v) => {
                object.insert((*last).to_owned(), v);
            }
            None => {
                object.remove(*last);
            }
        }
    }
}

/// The UID a copy or the stand-in carries when no running pod is adopted: derived from the
/// node, the file's name and its content, as the kubelet derives one for a static pod without
/// a UID, but with nothing of the kubelet's own: the kubelet hashes the pod as its version
/// decodes it (`pkg/kubelet/config/common.go`), so a kubelet of another minor gives the same
/// file another UID and replaces every static pod (etcd among them) at its upgrade. With the
/// UID in the file, the kubelet's upgrade keeps them; a changed file still gets a new UID, and
/// the mirror pod's `kubernetes.io/config.hash` that kubeadm waits on changes with it.
///
/// `pod` is the document as read ([`Manifest::static_uid`] for one read already); one this
/// build cannot read as a pod is hashed as it is (for kubeadm's own file, which carries
/// neither a UID nor the agent's grace period, that is the same).
pub fn static_uid(node: &str, name: &str, pod: &Value) -> String {
    match Manifest::from_value(pod.clone()) {
        Ok(m) => m.static_uid(node, name),
        Err(_) => uid_of(node, name, &crate::base::yaml::to_yaml(pod)),
    }
}

/// [`static_uid`] of the text `yaml` (the file as kubeadm wrote it).
fn uid_of(node: &str, name: &str, yaml: &str) -> String {
    let text = format!("{node}\n{name}\n{yaml}");
    sha256_hex(text.as_bytes())[..32].to_owned()
}

/// Takes out of `pod` what this agent adds to kubeadm's: its `metadata.uid` and the short
/// grace period of a restart in place
/// ([`RESTART_GRACE`](crate::node::kubeadm::sync::RESTART_GRACE), marked by [`GRACE_MARK`]).
fn strip_agents(pod: &mut Pod) {
    pod.metadata.uid = None;
    let marked = pod
        .metadata
        .annotations
        .as_mut()
        .is_some_and(|a| a.remove(GRACE_MARK).is_some());
    if marked {
        if pod
            .metadata
            .annotations
            .as_ref()
            .is_some_and(BTreeMap::is_empty)
        {
            pod.metadata.annotations = None;
        }
        if let Some(spec) = pod.spec.as_mut() {
            spec.termination_grace_period_seconds = None;
        }
    }
}

/// `pod` as kubeadm wrote it: without what this agent adds (`strip_agents`).
pub fn as_kubeadms(pod: &Pod) -> Pod {
    let mut p = pod.clone();
    strip_agents(&mut p);
    p
}

/// The annotation that marks the grace period as this agent's.
pub const GRACE_MARK: &str = "kube-apiserver-proxy/restart-grace";

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
