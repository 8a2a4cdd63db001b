//! kubeadm as the source of truth: `render` and `kubeadm-sync` (with `--undo` and
//! `--write-kubeconfig`, and its stand-in), the etcd canary, the lease handover, the `kubernetes` Service's
//! endpoints.

pub mod etcd_canary;
pub mod identity;
pub mod kubernetes_endpoints;
pub mod leader_handover;
pub mod render;
pub mod standin;
pub mod sync;
pub mod undo;
