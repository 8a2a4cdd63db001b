//! The stand-in: the static pod `kube-apiserver` that runs the `kubeadm-sync` agent in place
//! of kubeadm's apiserver on a migrated node, with kubeadm's labels, annotations, image and
//! readiness probe, so that kubeadm and Cluster API find the pod they look up (module
//! documentation of [`crate::node::kubeadm::sync`]).

use std::path::Path;

use k8s_openapi::api::core::v1::{
    Capabilities, EmptyDirVolumeSource, HostPathVolumeSource, ResourceRequirements, SecurityContext,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::node::apiserver_manifest::{StaticPod, CONTAINER};
use crate::node::kubeadm::render;
use crate::node::object::{Container, ObjectMeta, Pod, PodSpec, Volume, VolumeMount};

/// The stand-in's containers' security context: no capability (the agent, root, reads and
/// writes root's files under /etc/kubernetes as their owner), no escalation, a read-only root
/// file system (it writes only to its mounts).
fn least_privilege() -> SecurityContext {
    SecurityContext {
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        ..SecurityContext::default()
    }
}

/// Where the stand-in's container finds this binary (copied by its init container).
pub(crate) const BIN: &str = "/proxy-bin/kube-apiserver-proxy";

/// The stand-in: the static pod `kube-apiserver` that runs this agent (module documentation).
/// `command` is the agent's own command line after the binary.
pub fn standin(
    pod: &StaticPod,
    files: Option<&str>,
    proxy_image: &str,
    command: &[String],
    writable: &[&Path],
) -> Pod {
    let meta = &pod.pod.metadata;
    let mut annotations = render::kubeadm_annotations(pod);
    annotations.insert(render::MANIFEST_DIGEST.into(), pod.digest.clone());
    if let Some(f) = files {
        annotations.insert(render::FILES_DIGEST.into(), f.to_owned());
    }
    let mut labels = meta.labels.clone().unwrap_or_default();
    labels.insert(
        "app.kubernetes.io/part-of".into(),
        "kube-apiserver-proxy".into(),
    );
    let kubeadm = pod.container().ok();
    let mount = |name: &str, path: &str, read_only: bool| VolumeMount {
        name: name.to_owned(),
        mount_path: path.to_owned(),
        read_only: read_only.then_some(true),
        ..VolumeMount::default()
    };
    let host_path = |name: &str, path: &str, kind: &str| Volume {
        name: name.to_owned(),
        host_path: Some(HostPathVolumeSource {
            path: path.to_owned(),
            type_: Some(kind.to_owned()),
        }),
        ..Volume::default()
    };
    let mut container = Container {
        name: CONTAINER.to_owned(),
        image: Some(pod.image()),
        image_pull_policy: Some(
            kubeadm
                .and_then(|k| k.image_pull_policy.clone())
                .unwrap_or_else(|| "IfNotPresent".to_owned()),
        ),
        command: Some(
            std::iter::once(BIN.to_owned())
                .chain(command.iter().cloned())
                .collect(),
        ),
        resources: Some(ResourceRequirements {
            requests: Some(
                [("cpu", "10m"), ("memory", "16Mi")]
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), Quantity(v.to_owned())))
                    .collect(),
            ),
            ..ResourceRequirements::default()
        }),
        volume_mounts: Some(vec![
            mount("proxy-bin", "/proxy-bin", true),
            mount("etc-kubernetes", "/etc/kubernetes", true),
        ]),
        security_context: Some(least_privilege()),
        // kubeadm's readiness probe (through the node address) and the port it names.
        readiness_probe: kubeadm.and_then(|k| k.readiness_probe.clone()),
        ports: kubeadm.and_then(|k| k.ports.clone()),
        ..Container::default()
    };
    // Writable: kubeadm's manifest directory (the manifest set aside by `--once` is put back)
    // and the kubelet's, below the read-only /etc/kubernetes (its certificates and keys, the
    // kubeconfigs, what the apiserver's flags name: read for the digests and the API client).
    let mut volumes = vec![
        Volume {
            name: "proxy-bin".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity("64Mi".to_owned())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
        host_path("etc-kubernetes", "/etc/kubernetes", "Directory"),
    ];
    for (i, dir) in writable.iter().enumerate() {
        let name = format!("writable-{i}");
        let dir = dir.display().to_string();
        container
            .volume_mounts
            .get_or_insert_with(Vec::new)
            .push(mount(&name, &dir, false));
        volumes.push(host_path(&name, &dir, "DirectoryOrCreate"));
    }
    let kubeadm_spec = pod.pod.spec.as_ref();
    let spec = PodSpec {
        host_network: Some(true),
        priority_class_name: Some(
            kubeadm_spec
                .and_then(|s| s.priority_class_name.clone())
                .unwrap_or_else(|| "system-node-critical".to_owned()),
        ),
        termination_grace_period_seconds: Some(5),
        init_containers: Some(vec![Container {
            name: "install-proxy".to_owned(),
            image: Some(proxy_image.to_owned()),
            image_pull_policy: Some("IfNotPresent".to_owned()),
            command: Some(
                ["/kube-apiserver-proxy", "install", BIN]
                    .map(str::to_owned)
                    .to_vec(),
            ),
            volume_mounts: Some(vec![mount("proxy-bin", "/proxy-bin", false)]),
            security_context: Some(least_privilege()),
            ..Container::default()
        }]),
        containers: vec![container],
        volumes: Some(volumes),
        security_context: kubeadm_spec.and_then(|s| s.security_context.clone()),
        ..PodSpec::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: Some(
                meta.name
                    .clone()
                    .unwrap_or_else(|| "kube-apiserver".to_owned()),
            ),
            namespace: Some(
                meta.namespace
                    .clone()
                    .unwrap_or_else(|| "kube-system".to_owned()),
            ),
            labels: Some(labels),
            annotations: Some(annotations),
            ..ObjectMeta::default()
        },
        spec: Some(spec),
        status: None,
    }
}
