//! The node commands and agents: migration to and from kubeadm's static pod, recovery, rendering, probes.

pub mod api;
pub mod apiserver_manifest;
pub mod checkpoint;
pub mod checkpoint_metrics;
pub mod etcd_canary;
pub mod install;
pub mod kubeadm_identity;
pub mod kubeadm_sync;
pub mod kubeadm_undo;
pub mod kubeconfig;
pub mod kubernetes_endpoints;
pub mod launch;
pub mod leader_handover;
pub mod manifest;
pub mod migrate;
pub mod migrate_back;
pub mod object;
pub mod probe;
pub mod recover;
pub mod render;
pub mod served;
pub mod staticpod;
