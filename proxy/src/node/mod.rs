//! The node commands and agents, a folder per job; what several jobs share stays at this level.

pub mod api;
pub mod apiserver_manifest;
pub mod kubeadm;
pub mod kubeconfig;
pub mod manifest;
pub mod migration;
pub mod object;
pub mod pod;
pub mod recovery;
