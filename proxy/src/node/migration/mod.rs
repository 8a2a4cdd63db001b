//! Migration from kubeadm's static pod to the Deployment and back: `migrate`, `migrate-back`,
//! and the addresses the node serves.

pub mod migrate;
pub mod migrate_back;
pub mod served;
